"""The ``triton`` backend: Triton kernels on the shared GPU runtime (``parity.backends.gpu``), or
in Triton's interpreter on the CPU with ``TRITON_INTERPRET=1``. Registered as a plugin;
registering imports nothing heavy."""

from __future__ import annotations

from collections.abc import Callable

from parity.core.hookspecs import hookimpl


@hookimpl
def parity_register_backends(register: Callable[[type], None]) -> None:
    from parity.backends.triton.backend import TritonBackend

    register(TritonBackend)
