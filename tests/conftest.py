"""Shared fixtures. ``--backend NAME`` picks the backend(s) that backend-parametrised tests run
on (default: every installed backend); unavailable ones (no GPU here) skip cleanly."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import pytest

from parity.core.plugins import forget_backends, load_backends


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--backend",
        action="append",
        default=[],
        help="run backend-parametrised tests on this backend (repeatable; default: all)",
    )


def pytest_configure(config: pytest.Config) -> None:
    # under -n, xdist hands each worker a first block of (tests / workers / 4) consecutive
    # tests, which would give every long test (first: below) to the first worker; blocks of 4
    # spread them over the workers
    if getattr(config.option, "maxschedchunk", 0) is None:
        config.option.maxschedchunk = 4


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``long`` first, the rest in their order: under -n the long ones start on
    every worker while the short ones fill in behind them, rather than ending the run on one
    worker."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


def _registry():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a broken third-party plugin is reported elsewhere
        return load_backends()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend_name" in metafunc.fixturenames:
        names = metafunc.config.getoption("backend") or list(_registry().backends)
        metafunc.parametrize("backend_name", names)


@pytest.fixture(scope="session")
def registry():
    return _registry()


@pytest.fixture
def backend_cls(registry, backend_name):
    """The backend class under test; skipped (not failed) where it cannot run here."""
    if backend_name not in registry.backends:
        pytest.skip(f"backend {backend_name!r} is not installed")
    cls = registry.backends[backend_name]
    ok = cls.available()
    if not ok.ok:
        pytest.skip(f"backend {backend_name!r} unavailable here: {ok.reason}")
    return cls


def _parity_home() -> Path:
    """Where pulled models live: ``$PARITY_HOME``, else ``$XDG_CACHE_HOME/parity``, else
    ``~/.cache/parity`` (the same rule as ``parity.hub.registry``)."""
    if home := os.environ.get("PARITY_HOME"):
        return Path(home)
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "parity"


@pytest.fixture(scope="session")
def real_model():
    """``real_model(name)`` is the path of a pulled real model; the test skips when it is not
    cached (CI pulls smollm2-135m and gemma3-270m; ``parity pull qwen2.5-coder-0.5b`` enables
    the rest)."""

    def find(name: str) -> Path:
        path = _parity_home() / "models" / f"{name}.gguf"
        if not path.is_file():
            pytest.skip(f"{name} is not pulled; run `parity pull {name}`")
        return path

    return find


@pytest.fixture
def sloppy_plugin(tmp_path, monkeypatch):
    """``faulty_backends.SloppyBackend`` installed as the entry-point plugin ``sloppy``, for this
    process (sys.path) and the processes it starts (PYTHONPATH)."""
    from faulty_backends import PLUGIN_SOURCE

    (tmp_path / "ptest_sloppy.py").write_text(PLUGIN_SOURCE)
    dist = tmp_path / "ptest_sloppy-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ptest-sloppy\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[parity]\nsloppy = ptest_sloppy\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    here = str(Path(__file__).parent)  # where faulty_backends lives
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), here, *sys.path]))
    forget_backends()  # plugins load once per process: this one has a new one
    yield tmp_path
    forget_backends()
