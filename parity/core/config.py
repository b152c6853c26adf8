"""Configuration: which backend, which numerics, strict or not, and per-backend options.

Precedence, highest first (each layer overrides only the keys it sets):

1. explicit arguments (``parity.load(..., backend="cuda")``, CLI flags)
2. environment: ``PARITY_BACKEND``, ``PARITY_NUMERICS``, ``PARITY_STRICT``
3. the config file: ``$PARITY_CONFIG`` if set, else ``./parity.toml`` if present, else
   ``$XDG_CONFIG_HOME/parity/config.toml`` (``~/.config/parity/config.toml``)
4. defaults: ``backend = "auto"``, ``numerics = "exact"``, ``strict = false``

The file looks like::

    backend = "cuda"        # a backend name, or "auto"
    numerics = "exact"      # or "fast"
    strict = false          # true: any fallback to another backend is an error

    [backends.cuda]         # options handed to that backend's constructor
    graphs = true

The environment is read once, when a Config is loaded.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from parity.core.backend import NUMERICS, Backend, Device
from parity.core.plugins import Registry
from parity.errors import ConfigError

AUTO = "auto"
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}


@attrs.frozen
class Config:
    backend: str = AUTO
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
    unknown = set(data) - {"backend", "numerics", "strict", "backends"}
    if unknown:
        raise ConfigError(
            f"{path}: unknown key(s) {', '.join(sorted(unknown))}; "
            "known: backend, numerics, strict, [backends.NAME]"
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


def load_config(
    *,
    backend: str | None = None,
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
    from_env: dict[str, Any] = {}
    if env.get("PARITY_BACKEND"):
        from_env["backend"] = env["PARITY_BACKEND"]
    if env.get("PARITY_NUMERICS"):
        from_env["numerics"] = env["PARITY_NUMERICS"]
    if "PARITY_STRICT" in env:
        from_env["strict"] = _env_bool("PARITY_STRICT", env["PARITY_STRICT"])
    layers.append(("environment", from_env))
    explicit = {"backend": backend, "numerics": numerics, "strict": strict}
    layers.append(("argument", {k: v for k, v in explicit.items() if v is not None}))

    values: dict[str, Any] = {"backend": AUTO, "numerics": "exact", "strict": False}
    source = dict.fromkeys(values, "default")
    for where, layer in layers:
        for key in ("backend", "numerics", "strict"):
            if key in layer:
                values[key], source[key] = layer[key], where
    if not isinstance(values["backend"], str) or not values["backend"]:
        raise ConfigError(f"backend must be a backend name or 'auto' (from {source['backend']})")
    if values["numerics"] not in NUMERICS:
        raise ConfigError(
            f"numerics must be one of {', '.join(NUMERICS)}, got {values['numerics']!r} "
            f"(from {source['numerics']})"
        )
    options = layers[0][1].get("backends", {}) if file_path is not None else {}
    return Config(values["backend"], values["numerics"], bool(values["strict"]), options, source)


@attrs.frozen
class Choice:
    """A backend class and the device it will run on, with the reason it was picked."""

    cls: type[Backend]
    device: Device
    reason: str


def choose_backend(config: Config, registry: Registry) -> Choice:
    """Pick the backend and device: the configured one, or under ``auto`` the available
    (backend, device) with the highest score, earlier registration winning ties."""
    if config.backend != AUTO:
        try:
            cls = registry.get(config.backend)
        except Exception as e:
            raise ConfigError(f"{e} (backend from {config.source.get('backend')})") from None
        ok = cls.available()
        if not ok.ok:
            raise ConfigError(
                f"backend {cls.name!r} is not available here: {ok.reason}. Choose another "
                f"with --backend / PARITY_BACKEND, or use 'auto'"
            )
        _check_numerics(cls, config.numerics)
        devices = cls.devices()
        if not devices:
            raise ConfigError(f"backend {cls.name!r} reports no devices")
        return Choice(cls, devices[0], f"{cls.name} requested ({config.source.get('backend')})")
    candidates: list[tuple[int, int, type[Backend], Device]] = []
    skipped = []
    for order, cls in enumerate(registry.backends.values()):
        ok = cls.available()
        if not ok.ok:
            skipped.append(f"{cls.name}: {ok.reason}")
            continue
        if config.numerics not in cls.numerics_modes:
            skipped.append(f"{cls.name}: no {config.numerics} numerics")
            continue
        candidates += [(cls.score(d), -order, cls, d) for d in cls.devices()]
    if not candidates:
        raise ConfigError(f"no backend is available: {'; '.join(skipped) or 'none installed'}")
    score, _, cls, device = max(candidates, key=lambda c: c[:2])
    why = f"auto: highest score {score} on {device.id}"
    return Choice(cls, device, why + (f" (skipped {'; '.join(skipped)})" if skipped else ""))


def _check_numerics(cls: type[Backend], numerics: str) -> None:
    if numerics not in cls.numerics_modes:
        raise ConfigError(
            f"backend {cls.name!r} offers numerics {', '.join(cls.numerics_modes)}, "
            f"not {numerics!r}"
        )


def make_backends(config: Config, registry: Registry) -> list[Backend]:
    """Instances in priority order: the chosen backend, then ``cpu`` as the fallback."""
    choice = choose_backend(config, registry)
    chain: Sequence[tuple[type[Backend], Device]] = [(choice.cls, choice.device)]
    if choice.cls.name != "cpu":
        cpu = registry.get("cpu")
        chain = [*chain, (cpu, cpu.devices()[0])]
    return [
        cls(device, numerics=config.numerics, options=config.backend_options.get(cls.name, {}))
        for cls, device in chain
    ]
