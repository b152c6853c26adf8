"""Which implementation the cpu backend runs, and on how many threads.

``definition`` is the readable definition of every op (``ops.py``, ``parity.quant``): the
oracle, what the conformance kit and ``parity compare`` measure against. ``numpy`` is the
definition with numpy kernels that are faster than it; ``numba`` runs the same operations,
compiled (``jit/``). All three give the same bits. The choice, highest precedence first: the
``kernels=`` constructor argument, ``PARITY_CPU_KERNELS``, the config file's
``[backends.cpu] kernels = ...``, then ``numba`` when it can be imported, else ``numpy``.
``threads`` (argument, ``PARITY_THREADS``, then ``[backends.cpu] threads``) fixes the count;
left out, every core numba may use is the ceiling and the thread governor (``threads.py``) runs
each short step on as many as turn out faster. Results never depend on it.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from parity.errors import ConfigError

ENV = "PARITY_CPU_KERNELS"
THREADS_ENV = "PARITY_THREADS"
MODES = ("numba", "numpy", "definition")


def numba_problem() -> str | None:
    """Why the numba kernels cannot load here, or None when they can."""
    try:
        import parity.backends.cpu.jit.ops  # noqa: F401  (imports numba and llvmlite)
    except Exception as err:  # a missing or broken numba/llvmlite install, whatever the error
        return f"{type(err).__name__}: {err}"
    return None


def choose_mode(requested: str | None, options: Mapping[str, Any], env: Mapping[str, str]) -> str:
    """``numpy`` or ``numba``, by the precedence in the module docstring."""
    for value, where in (
        (requested, "kernels={!r} (argument)"),
        (env.get(ENV) or None, ENV + "={!r}"),
        (options.get("kernels"), "[backends.cpu] kernels = {!r}"),
    ):
        if value is None:
            continue
        if value not in MODES:
            raise ConfigError(f"{where.format(value)}: use one of {', '.join(MODES)}")
        if value == "numba" and (problem := numba_problem()):
            raise ConfigError(
                f"{where.format(value)} asks for the numba cpu kernels, but they cannot load "
                f"({problem}); install numba or choose numpy"
            )
        return value
    if problem := numba_problem():
        warnings.warn(
            f"the cpu backend runs its numpy kernels: numba cannot load ({problem})", stacklevel=3
        )
        return "numpy"
    return "numba"


def choose_threads(
    requested: int | None,
    options: Mapping[str, Any],
    mode: str,
    env: Mapping[str, str] | None = None,
) -> tuple[int, bool]:
    """Threads for the numba kernels (1 otherwise: numpy's BLAS has its own settings), and
    whether that count is fixed (given) or a ceiling the thread governor may go below."""
    env = env or {}
    value, where = requested, "threads={!r} (argument)"
    if value is None and env.get(THREADS_ENV):
        raw = env[THREADS_ENV]
        value, where = (int(raw) if raw.strip().isdigit() else raw), THREADS_ENV + "={!r}"
    if value is None:
        value, where = options.get("threads"), "[backends.cpu] threads = {!r}"
    if mode != "numba":
        return 1, True
    import numba

    most = numba.config.NUMBA_NUM_THREADS
    if value is None:
        return most, False
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
        raise ConfigError(
            f"{where.format(value)}: use a whole number from 1 to {most} "
            "(numba's thread limit, NUMBA_NUM_THREADS)"
        )
    return value, True
