"""The ``cpu`` backend: numpy, the bit-exact reference oracle. Registered as a plugin."""

from __future__ import annotations

from collections.abc import Callable

from parity.core.hookspecs import hookimpl


@hookimpl
def parity_register_backends(register: Callable[[type], None]) -> None:
    from parity.backends.cpu.backend import CpuBackend

    register(CpuBackend)
