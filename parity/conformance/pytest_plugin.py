"""The conformance kit as a pytest plugin (entry point ``pytest11``: installed with parity).

In any repository, ``pytest --parity-backend NAME`` adds the op suite, one test per case, run on
backend NAME and judged against the cpu oracle under the tiers NAME declares;
``--parity-case FILE`` adds a case file saved by ``parity compare``. A backend that cannot run
here (no GPU) skips its cases; a case using an op the backend does not support skips, saying
which. Nothing happens without ``--parity-backend``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("parity", "parity conformance kit")
    group.addoption(
        "--parity-backend",
        action="append",
        default=[],
        metavar="NAME",
        help="run parity's op conformance suite against backend NAME (repeatable)",
    )
    group.addoption(
        "--parity-case",
        action="append",
        default=[],
        metavar="FILE",
        help="also replay this case file saved by `parity compare` (repeatable)",
    )
    group.addoption(
        "--parity-device", type=int, default=None, metavar="N", help="device index (default 0)"
    )


class ConformanceFailure(AssertionError):
    def __init__(self, explanation: str) -> None:
        super().__init__(explanation)
        self.explanation = explanation


class ConformanceSuite(pytest.Collector):
    """The suite for one backend: one item per case."""

    def __init__(self, *, backend: str, case_files: list[str], **kwargs) -> None:
        super().__init__(**kwargs)
        self.backend = backend
        self.case_files = case_files
        self._factory: Callable | None = None
        self._unusable = ""

    def factory(self) -> Callable:
        """The backend maker, made once; skips every case when the backend cannot run here."""
        if self._factory is None and not self._unusable:
            from parity.conformance.report import backend_factory
            from parity.core.plugins import load_backends
            from parity.errors import PluginError

            try:
                device = self.config.getoption("parity_device")
                self._factory = backend_factory(load_backends(), self.backend, device)
            except PluginError as e:
                self._unusable = str(e)
        if self._unusable:
            pytest.skip(self._unusable)
        assert self._factory is not None
        return self._factory

    def collect(self) -> list[pytest.Item]:
        from parity.conformance.case import load_case
        from parity.conformance.suite import op_suite

        items = [CaseItem.from_parent(self, name=s.id, build=s.build) for s in op_suite()]
        for path in self.case_files:
            case = load_case(path)
            items.append(
                CaseItem.from_parent(self, name=f"replay-{case.id}", build=lambda c=case: c)
            )
        return items


class CaseItem(pytest.Item):
    def __init__(self, *, build: Callable, **kwargs) -> None:
        super().__init__(**kwargs)
        self.build = build

    def runtest(self) -> None:
        from parity.conformance.harness import judge

        assert isinstance(self.parent, ConformanceSuite)
        result = judge(self.parent.factory(), self.build())
        if result.verdict == "unsupported":
            pytest.skip(f"{self.parent.backend} does not support it: {result.explain()}")
        self.user_properties.append(("verdict", result.verdict))
        if result.failed:
            raise ConformanceFailure(result.explain())

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, ConformanceFailure):
            return excinfo.value.explanation
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self):
        return self.path, None, f"{self.parent.name}::{self.name}"


@pytest.hookimpl(tryfirst=True)  # before -k and -m deselect items
def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    backends = config.getoption("parity_backend")
    case_files = config.getoption("parity_case")
    if case_files and not backends:
        raise pytest.UsageError("--parity-case needs --parity-backend NAME: the backend to run on")
    if backends:
        from parity.core.plugins import load_backends
        from parity.errors import PluginError

        registry = load_backends()
        for name in backends:
            try:
                registry.get(name)
            except PluginError as e:
                raise pytest.UsageError(f"--parity-backend: {e}") from None
    for name in dict.fromkeys(backends):
        suite = ConformanceSuite.from_parent(
            session, name=f"parity-conformance[{name}]", backend=name, case_files=case_files
        )
        items.extend(suite.collect())
