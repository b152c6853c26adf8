"""The plugin manager: hookspecs, the ``parity`` entry-point group, the built-in backends.

``PARITY_PLUGINS`` limits which installed plugins load: ``jax`` loads only that one; ``-jax``
(or ``-jax,-other``) loads all but those. The filter applies to the built-in ``cuda`` and
``triton`` too; ``cpu`` always loads: it is the oracle and the fallback every runtime needs. A
plugin that fails to import, declares a hook parity does not have, or fails to register is
reported by name and skipped; every other backend keeps working.
"""

from __future__ import annotations

import importlib
import os
import warnings
from collections.abc import Mapping
from importlib.metadata import entry_points

import attrs
import pluggy

from parity.core import hookspecs
from parity.core.backend import PLUGIN_API_VERSION, Backend
from parity.core.tiers import backend_manifest
from parity.errors import PluginError

ENTRY_POINT_GROUP = "parity"
ENV_VAR = "PARITY_PLUGINS"
DEFAULT_PLUGINS = {
    "cpu": "parity.backends.cpu",
    "cuda": "parity.backends.cuda",
    "triton": "parity.backends.triton",
}


class PluginWarning(UserWarning):
    """A plugin could not be loaded, or PARITY_PLUGINS names none; the rest of parity works."""


class PluginFilterWarning(PluginWarning):
    """``PARITY_PLUGINS`` names a plugin that is not installed (a typo hides nothing)."""


@attrs.define
class Registry:
    """What the plugins registered: backend classes by name, and broken plugins with why."""

    backends: dict[str, type[Backend]] = attrs.Factory(dict)
    owners: dict[str, str] = attrs.Factory(dict)  # backend name -> plugin name
    broken: dict[str, str] = attrs.Factory(dict)  # plugin name -> one-line reason

    def get(self, name: str) -> type[Backend]:
        if name in self.backends:
            return self.backends[name]
        if name in self.broken:  # plugins are usually named after their backend
            raise PluginError(
                f"backend {name!r} is not available: its plugin {name!r} is broken "
                f"({self.broken[name]}); see `parity backends`"
            )
        known = ", ".join(self.backends) or "none"
        hint = f" (broken plugins: {', '.join(self.broken)})" if self.broken else ""
        raise PluginError(f"unknown backend {name!r}; installed backends: {known}{hint}")


def plugin_filter(value: str | None) -> tuple[set[str] | None, set[str]]:
    """Parse ``PARITY_PLUGINS`` into (only these or None for all, never these)."""
    names = [n.strip() for n in (value or "").split(",") if n.strip()]
    exclude = {n[1:] for n in names if n.startswith("-")}
    include = {n for n in names if not n.startswith("-")}
    return (include or None), exclude


def plugin_manager(
    env: Mapping[str, str] | None = None,
) -> tuple[pluggy.PluginManager, dict[str, str]]:
    """Create the manager, add hookspecs, register the built-ins and the entry points that
    ``PARITY_PLUGINS`` allows. Returns it and the plugins that failed to load, with why."""
    env = os.environ if env is None else env
    include, exclude = plugin_filter(env.get(ENV_VAR))
    pm = pluggy.PluginManager("parity")
    pm.add_hookspecs(hookspecs)
    broken: dict[str, str] = {}

    def wanted(name: str) -> bool:
        return name == "cpu" or not (
            (include is not None and name not in include) or name in exclude
        )

    for name, target in DEFAULT_PLUGINS.items():
        if wanted(name):
            pm.register(importlib.import_module(target), name=name)
    installed = {*DEFAULT_PLUGINS}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        name = ep.name
        installed.add(name)
        if name == "cpu" or not wanted(name):
            continue
        if pm.has_plugin(name):
            broken.setdefault(name, f"another plugin already uses the name {name!r}")
            continue
        try:
            module = ep.load()
        except Exception as e:  # a broken plugin must not take the others down
            broken[name] = f"failed to import {ep.value}: {type(e).__name__}: {e}"
            continue
        try:
            pm.register(module, name=name)
            pm.check_pending()  # a misspelled hook would otherwise be ignored silently
        except Exception as e:  # PluginValidationError: bad signature or unknown hook
            if pm.has_plugin(name):
                pm.unregister(name=name)
            broken[name] = f"rejected: {type(e).__name__}: {e}"
    unknown = sorted(((include or set()) | exclude) - installed)
    if unknown:
        warnings.warn(
            PluginFilterWarning(
                f"{ENV_VAR} names {', '.join(map(repr, unknown))}, which no installed plugin "
                f"is; installed: {', '.join(sorted(installed))}"
            ),
            stacklevel=2,
        )
    return pm, broken


def collect_backends(pm: pluggy.PluginManager, broken: Mapping[str, str] = ()) -> Registry:
    """Call every plugin's ``parity_register_backends`` on its own, so one failing plugin is
    reported and the others still register."""
    registry = Registry(broken=dict(broken))
    for impl in pm.hook.parity_register_backends.get_hookimpls():
        plugin = impl.plugin_name
        offered: list[type] = []
        try:
            hook_args = {"register": offered.append}
            impl.function(*(hook_args[a] for a in impl.argnames))
            names = [getattr(cls, "name", None) for cls in offered]
            for cls in offered:
                _check_backend_class(cls, registry)
                if names.count(cls.name) > 1:
                    raise PluginError(f"registers two backends named {cls.name!r}")
        except Exception as e:
            registry.broken[plugin] = f"failed to register: {type(e).__name__}: {e}"
            continue
        for cls in offered:
            registry.backends[cls.name] = cls
            registry.owners[cls.name] = plugin
    for plugin, reason in registry.broken.items():
        warnings.warn(
            f"parity plugin {plugin!r} is broken and was skipped: {reason}. Other backends "
            f"keep working; silence it with {ENV_VAR}=-{plugin}",
            PluginWarning,
            stacklevel=2,
        )
    return registry


def _check_backend_class(cls: type, registry: Registry) -> None:
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise PluginError(f"{cls!r} is not a subclass of parity.core.backend.Backend")
    if not cls.name:
        raise PluginError(f"{cls.__name__} has no backend name")
    if cls.api_version != PLUGIN_API_VERSION:
        raise PluginError(
            f"backend {cls.name!r} targets plugin API version {cls.api_version}, this parity "
            f"speaks {PLUGIN_API_VERSION}; upgrade the plugin or parity"
        )
    backend_manifest(cls)  # a bad declaration is a PluginError naming the backend
    backend_manifest(cls, "fast")
    if cls.name in registry.backends:
        raise PluginError(
            f"backend name {cls.name!r} is already registered by plugin "
            f"{registry.owners[cls.name]!r}"
        )


_loaded: Registry | None = None


def load_backends(env: Mapping[str, str] | None = None) -> Registry:
    """The installed backends: built-ins and entry points, broken plugins reported (one warning
    each). Loaded once per process from ``os.environ``; an explicit ``env`` loads afresh."""
    global _loaded
    if env is not None:
        return collect_backends(*plugin_manager(env))
    if _loaded is None:
        _loaded = collect_backends(*plugin_manager(os.environ))
    return _loaded


def forget_backends() -> None:
    """Make the next ``load_backends()`` load the plugins again (after installing or removing
    one in this process, as tests do)."""
    global _loaded
    _loaded = None
