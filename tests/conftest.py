"""Shared fixtures. ``--backend NAME`` picks the backend(s) that backend-parametrised tests run
on (default: every installed backend); unavailable ones (no GPU here) skip cleanly."""

from __future__ import annotations

import warnings

import pytest

from parity.core.plugins import load_backends


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--backend",
        action="append",
        default=[],
        help="run backend-parametrised tests on this backend (repeatable; default: all)",
    )


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
