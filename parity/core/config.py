"""Configuration: which backend, which numerics, strict or not, and per-backend options. Settings
only: which backend instances they make is ``parity.core.selection``'s business.

Precedence, highest first (each layer overrides only the keys it sets):

1. explicit arguments (``parity.load(..., backend="cuda")``, CLI flags)
2. environment: ``PARITY_BACKEND``, ``PARITY_DEVICE``, ``PARITY_NUMERICS``, ``PARITY_STRICT``
   (an empty variable counts as unset)
3. the config file: ``$PARITY_CONFIG`` if set, else ``./parity.toml`` if present, else
   ``$XDG_CONFIG_HOME/parity/config.toml`` (``~/.config/parity/config.toml``)
4. defaults: ``backend = "auto"``, no device (the backend's first, or the best under auto),
   ``numerics = "exact"``, ``strict = false``

The file looks like::

    backend = "cuda"        # a backend name, or "auto"
    device = 1              # which of the backend's devices (cuda:1); omit for the default
    numerics = "exact"      # or "fast"
    strict = false          # true: any fallback to another backend is an error

    [backends.cuda]         # options handed to that backend's constructor
    graphs = true

The environment is read once, when a Config is loaded.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from parity.core.backend import NUMERICS
from parity.errors import ConfigError

AUTO = "auto"
KEYS = ("backend", "device", "numerics", "strict")
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}


@attrs.frozen
class Config:
    backend: str = AUTO
    device: int | None = None
    numerics: str = "exact"
    strict: bool = False
    backend_options: Mapping[str, Mapping[str, Any]] = attrs.field(factory=dict, eq=False)
    source: Mapping[str, str] = attrs.field(factory=dict, eq=False)  # key -> where it came from


def config_path(env: Mapping[str, str], cwd: Path) -> Path | None:
    if env.get("PARITY_CONFIG"):
        path = Path(env["PARITY_CONFIG"]).expanduser()
        if not path.is_file():
            raise ConfigError(f"PARITY_CONFIG points to {path}, which is not a file")
        return path
    if (cwd / "parity.toml").is_file():
        return cwd / "parity.toml"
    home = Path(env.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    path = home / "parity" / "config.toml"
    return path if path.is_file() else None


def _read_file(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None
    unknown = set(data) - {*KEYS, "backends"}
    if unknown:
        raise ConfigError(
            f"{path}: unknown key(s) {', '.join(sorted(unknown))}; "
            f"known: {', '.join(KEYS)}, [backends.NAME]"
        )
    options = data.get("backends", {})
    if not isinstance(options, dict) or not all(isinstance(v, dict) for v in options.values()):
        raise ConfigError(f"{path}: [backends.NAME] sections must be tables of options")
    if "strict" in data and not isinstance(data["strict"], bool):
        raise ConfigError(f"{path}: strict must be true or false")
    return data


def _env_bool(name: str, value: str) -> bool:
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise ConfigError(f"{name}={value!r}: use 1/0, true/false, yes/no or on/off")


def _device(value: Any, where: str) -> int:
    try:
        index = int(value)
    except (TypeError, ValueError):
        index = -1
    if isinstance(value, bool) or index < 0:
        raise ConfigError(f"device must be a device index (0, 1, ...), got {value!r} ({where})")
    return index


def load_config(
    *,
    backend: str | None = None,
    device: int | None = None,
    numerics: str | None = None,
    strict: bool | None = None,
    path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> Config:
    """Resolve the configuration; arguments left as None fall through to lower layers."""
    env = os.environ if env is None else env
    file_path = Path(path) if path is not None else config_path(env, cwd or Path.cwd())
    layers: list[tuple[str, dict[str, Any]]] = []
    if file_path is not None:
        layers.append((str(file_path), _read_file(file_path)))
    from_env: dict[str, Any] = {
        key: env[f"PARITY_{key.upper()}"] for key in KEYS if env.get(f"PARITY_{key.upper()}")
    }
    if "strict" in from_env:
        from_env["strict"] = _env_bool("PARITY_STRICT", from_env["strict"])
    layers.append(("environment", from_env))
    explicit = {"backend": backend, "device": device, "numerics": numerics, "strict": strict}
    layers.append(("argument", {k: v for k, v in explicit.items() if v is not None}))

    values: dict[str, Any] = {"backend": AUTO, "device": None, "numerics": "exact", "strict": False}
    source = dict.fromkeys(values, "default")
    for where, layer in layers:
        for key in KEYS:
            if key in layer:
                values[key], source[key] = layer[key], where
    if values["device"] is not None:
        values["device"] = _device(values["device"], source["device"])
    if not isinstance(values["backend"], str) or not values["backend"]:
        raise ConfigError(f"backend must be a backend name or 'auto' (from {source['backend']})")
    if values["numerics"] not in NUMERICS:
        raise ConfigError(
            f"numerics must be one of {', '.join(NUMERICS)}, got {values['numerics']!r} "
            f"(from {source['numerics']})"
        )
    options = layers[0][1].get("backends", {}) if file_path is not None else {}
    return Config(
        values["backend"],
        values["device"],
        values["numerics"],
        bool(values["strict"]),
        options,
        source,
    )
