"""Config precedence (argument > environment > file > default), validation, and backend choice
(``auto`` by score per device; an unavailable choice explained)."""

from __future__ import annotations

import pytest

from parity.backends.cpu.backend import CpuBackend
from parity.core.backend import Availability, Device
from parity.core.config import Config, load_config
from parity.core.plugins import Registry
from parity.core.selection import choose_backend, make_backends
from parity.errors import ConfigError


@pytest.fixture
def cwd(tmp_path):
    return tmp_path


def write(path, text):
    path.write_text(text)
    return path


def test_defaults(cwd):
    c = load_config(env={"XDG_CONFIG_HOME": str(cwd / "none")}, cwd=cwd)
    assert (c.backend, c.numerics, c.strict) == ("auto", "exact", False)
    assert set(c.source.values()) == {"default"}


def test_precedence_argument_env_file_default(cwd):
    write(cwd / "parity.toml", 'backend = "fromfile"\nnumerics = "fast"\nstrict = true\n')
    env = {"PARITY_BACKEND": "fromenv"}
    c = load_config(env=env, cwd=cwd)
    assert (c.backend, c.numerics, c.strict) == ("fromenv", "fast", True)
    assert c.source == {
        "backend": "environment",
        "device": "default",
        "numerics": str(cwd / "parity.toml"),
        "strict": str(cwd / "parity.toml"),
    }
    c = load_config(backend="fromarg", strict=False, env={**env, "PARITY_STRICT": "1"}, cwd=cwd)
    assert (c.backend, c.strict) == ("fromarg", False)
    assert c.source["strict"] == "argument"


def test_file_locations(tmp_path, cwd):
    xdg = tmp_path / "xdg"
    (xdg / "parity").mkdir(parents=True)
    write(xdg / "parity" / "config.toml", 'backend = "user"\n[backends.user]\nthreads = 2\n')
    c = load_config(env={"XDG_CONFIG_HOME": str(xdg)}, cwd=cwd)
    assert c.backend == "user" and c.backend_options == {"user": {"threads": 2}}
    explicit = write(tmp_path / "other.toml", 'backend = "other"\n')
    assert load_config(env={"PARITY_CONFIG": str(explicit)}, cwd=cwd).backend == "other"
    with pytest.raises(ConfigError, match="PARITY_CONFIG points to"):
        load_config(env={"PARITY_CONFIG": str(tmp_path / "nope.toml")}, cwd=cwd)


@pytest.mark.parametrize(
    "text, message",
    [
        ('backend = "cpu"\nbakend = "x"\n', "unknown key"),
        ("backend = \n", "cannot read config file"),
        ('numerics = "approximate"\n', "numerics must be one of exact, fast"),
        ('strict = "yes"\n', "strict must be true or false"),
        ("backends = 3\n", r"\[backends.NAME\] sections"),
    ],
)
def test_bad_files(cwd, text, message):
    write(cwd / "parity.toml", text)
    with pytest.raises(ConfigError, match=message):
        load_config(env={}, cwd=cwd)


def test_empty_environment_variables_count_as_unset(cwd):
    write(cwd / "parity.toml", 'backend = "fromfile"\nstrict = true\n')
    c = load_config(env={"PARITY_BACKEND": "", "PARITY_STRICT": ""}, cwd=cwd)
    assert (c.backend, c.strict) == ("fromfile", True)


def test_bad_environment(cwd):
    with pytest.raises(ConfigError, match="PARITY_STRICT='maybe'"):
        load_config(env={"PARITY_STRICT": "maybe"}, cwd=cwd)
    with pytest.raises(ConfigError, match="from environment"):
        load_config(env={"PARITY_NUMERICS": "fastest"}, cwd=cwd)


class FakeGpu(CpuBackend):
    name = "fakegpu"
    present = True

    @classmethod
    def available(cls):
        return Availability(cls.present, "" if cls.present else "no GPU found (driver missing)")

    @classmethod
    def devices(cls):
        return [Device("fakegpu", 0, "small"), Device("fakegpu", 1, "big")]

    @classmethod
    def score(cls, device):
        return 100 + device.index


@pytest.fixture
def registry():
    FakeGpu.present = True
    return Registry(
        backends={"cpu": CpuBackend, "fakegpu": FakeGpu}, owners={"cpu": "cpu", "fakegpu": "fake"}
    )


def test_auto_picks_highest_score_per_device(registry):
    choice = choose_backend(Config(), registry)
    assert choice.cls is FakeGpu and choice.device.index == 1
    backends = make_backends(Config(), registry)
    assert [b.name for b in backends] == ["fakegpu", "cpu"]  # cpu stays as the fallback


def test_device_selection(registry, cwd):
    assert choose_backend(Config(backend="fakegpu", device=0), registry).device.index == 0
    assert choose_backend(Config(device=0), registry).device.id == "fakegpu:0"
    with pytest.raises(ConfigError, match=r"has no device 5 \(it has fakegpu:0, fakegpu:1\)"):
        choose_backend(Config(backend="fakegpu", device=5, source={"device": "argument"}), registry)
    assert load_config(env={"PARITY_DEVICE": "1"}, cwd=cwd).device == 1
    with pytest.raises(ConfigError, match="device must be a device index"):
        load_config(env={"PARITY_DEVICE": "cuda:1"}, cwd=cwd)


def test_auto_without_gpu_falls_to_cpu(registry):
    FakeGpu.present = False
    choice = choose_backend(Config(), registry)
    assert choice.cls is CpuBackend and "driver missing" in choice.reason
    assert [b.name for b in make_backends(Config(), registry)] == ["cpu"]


def test_explicit_backend_unavailable_is_explained(registry):
    FakeGpu.present = False
    with pytest.raises(ConfigError, match="'fakegpu' is not available here: no GPU found"):
        choose_backend(Config(backend="fakegpu"), registry)
    with pytest.raises(ConfigError, match="unknown backend 'cuda'"):
        choose_backend(Config(backend="cuda", source={"backend": "argument"}), registry)


def test_numerics_the_backend_cannot_honour(registry):
    class ExactOnly(FakeGpu):
        name = "exactonly"
        numerics_modes = ("exact",)

    registry.backends["exactonly"] = ExactOnly
    with pytest.raises(ConfigError, match="offers numerics exact, not 'fast'"):
        choose_backend(Config(backend="exactonly", numerics="fast"), registry)
    backends = make_backends(Config(numerics="fast"), registry)
    assert backends[0].numerics == "fast"
