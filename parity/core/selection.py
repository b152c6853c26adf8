"""From settings to backends: the backend class and device a configuration selects (``auto`` by
score), and the instances a runtime runs on (the choice, then ``cpu`` as the fallback)."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from parity.core.backend import Backend, Device
from parity.core.config import AUTO, Config
from parity.core.plugins import Registry
from parity.errors import ConfigError


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
        devices = _pick_devices(cls, config)
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
        if config.device is not None and config.device >= len(cls.devices()):
            skipped.append(f"{cls.name}: no device {config.device}")
            continue
        candidates += [(cls.score(d), -order, cls, d) for d in _pick_devices(cls, config)]
    if not candidates:
        raise ConfigError(f"no backend is available: {'; '.join(skipped) or 'none installed'}")
    score, _, cls, device = max(candidates, key=lambda c: c[:2])
    why = f"auto: highest score {score} on {device.id}"
    return Choice(cls, device, why + (f" (skipped {'; '.join(skipped)})" if skipped else ""))


def _pick_devices(cls: type[Backend], config: Config) -> list[Device]:
    devices = cls.devices()
    if not devices:
        raise ConfigError(f"backend {cls.name!r} reports no devices here; choose another")
    if config.device is None:
        return devices
    if config.device >= len(devices):
        have = ", ".join(d.id for d in devices)
        raise ConfigError(
            f"backend {cls.name!r} has no device {config.device} (it has {have}); "
            f"fix device (from {config.source.get('device')})"
        )
    return [devices[config.device]]


def _check_numerics(cls: type[Backend], numerics: str) -> None:
    if numerics not in cls.numerics_modes:
        raise ConfigError(
            f"backend {cls.name!r} offers numerics {', '.join(cls.numerics_modes)}, "
            f"not {numerics!r}; set numerics to one of those or choose another backend"
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
