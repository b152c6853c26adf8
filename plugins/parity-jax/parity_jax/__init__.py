"""parity-jax: a JAX backend for parity, installed as a separate distribution.

The ``parity`` entry point names this module; parity's plugin manager registers its hook.
Registering imports neither jax nor the backend's own modules that use it.
"""

from __future__ import annotations

from collections.abc import Callable

from parity.core.hookspecs import hookimpl


@hookimpl
def parity_register_backends(register: Callable[[type], None]) -> None:
    from parity_jax.backend import JaxBackend

    register(JaxBackend)
