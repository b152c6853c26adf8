"""The hooks a parity plugin implements. Built-in backends use them exactly as outside
packages do; an outside package points an entry point in the ``parity`` group at the module
or object that implements them. What a backend class must provide is
``parity.core.backend.Backend``."""

from __future__ import annotations

from collections.abc import Callable

import pluggy

hookspec = pluggy.HookspecMarker("parity")
hookimpl = pluggy.HookimplMarker("parity")


@hookspec
def parity_register_backends(register: Callable[[type], None]) -> None:
    """Register backend classes.

    Called once when the plugin manager collects backends. Call ``register(BackendClass)`` for
    each subclass of ``parity.core.backend.Backend`` the plugin provides. Registering must be
    cheap: import nothing heavy and touch no device (do that in ``available`` and the
    constructor). A class whose ``api_version`` differs from the runtime's plugin API version,
    or whose ``name`` is taken, is refused, and then the whole plugin is reported as broken and
    none of its classes register. Returns nothing.
    """
