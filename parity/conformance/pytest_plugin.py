"""The conformance kit as a pytest plugin (entry point ``pytest11``: installed with parity).

In any repository, ``pytest --parity-backend NAME`` adds the op suite, one test per case, run on
backend NAME and judged against the cpu oracle under the tiers NAME declares;
``--parity-case FILE`` adds a case file saved by ``parity compare``. A backend that cannot run
here (no GPU) skips its cases; a case using an op the backend does not support skips, saying
which. Nothing happens without ``--parity-backend``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from parity.conformance.case import Case
    from parity.core.backend import Backend


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
    """The suite for one backend: one item per case. ``factory`` makes backend instances;
    None when the backend cannot run here, and then ``unusable`` says why."""

    def __init__(
        self,
        *,
        factory: Callable[[], Backend] | None,
        unusable: str,
        cases: list[Case],
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.factory = factory
        self.unusable = unusable
        self.cases = cases

    def collect(self) -> list[pytest.Item]:
        from parity.conformance.suite import op_suite

        items = [CaseItem.from_parent(self, name=s.id, build=s.build) for s in op_suite()]
        for case in self.cases:
            items.append(
                CaseItem.from_parent(self, name=f"replay-{case.id}", build=lambda c=case: c)
            )
        return items


class CaseItem(pytest.Item):
    def __init__(self, *, build: Callable[[], Case], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.build = build

    def runtest(self) -> None:
        from parity.conformance.harness import judge

        suite = self.parent
        assert isinstance(suite, ConformanceSuite)
        if suite.factory is None:
            pytest.skip(suite.unusable)
        result = judge(suite.factory, self.build())
        if result.verdict == "unsupported":
            pytest.skip(f"unsupported: {result.explain()}")
        self.user_properties.append(("verdict", result.verdict))
        if result.failed:
            raise ConformanceFailure(result.explain())

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style=None) -> str:
        if isinstance(excinfo.value, ConformanceFailure):
            return excinfo.value.explanation
        return str(super().repr_failure(excinfo, style=style))

    def reportinfo(self) -> tuple[Any, int | None, str]:
        return self.path, None, f"{self.parent.name}::{self.name}"


@pytest.hookimpl(tryfirst=True)  # before -k and -m deselect items
def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    backends = list(dict.fromkeys(config.getoption("parity_backend")))
    case_files = config.getoption("parity_case")
    if case_files and not backends:
        raise pytest.UsageError("--parity-case needs --parity-backend NAME: the backend to run on")
    if not backends:
        return
    from parity.conformance.case import load_case
    from parity.conformance.report import BackendUnavailable, backend_factory
    from parity.core.plugins import load_backends
    from parity.errors import ParityError

    registry = load_backends()
    try:
        cases = [load_case(path) for path in case_files]
    except ParityError as e:
        raise pytest.UsageError(f"--parity-case: {e}") from None
    for name in backends:
        factory, unusable = None, ""
        try:
            factory = backend_factory(registry, name, config.getoption("parity_device"))
        except BackendUnavailable as e:  # no GPU here: skip, so CI without one stays green
            unusable = str(e)
        except ParityError as e:  # not installed, broken, no such device: the command is wrong
            raise pytest.UsageError(f"--parity-backend {name}: {e}") from None
        suite = ConformanceSuite.from_parent(
            session, name=f"parity-conformance[{name}]", factory=factory, unusable=unusable,
            cases=cases,
        )  # fmt: skip
        items.extend(suite.collect())
