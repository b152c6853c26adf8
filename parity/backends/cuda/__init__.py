"""The ``cuda`` backend: CUDA C kernels compiled at run time with NVRTC, on the shared GPU runtime
(``parity.backends.gpu``). Registered as a plugin; registering imports nothing heavy."""

from __future__ import annotations

from collections.abc import Callable

from parity.core.hookspecs import hookimpl


@hookimpl
def parity_register_backends(register: Callable[[type], None]) -> None:
    from parity.backends.cuda.backend import CudaBackend

    register(CudaBackend)
