"""How every kernel is compiled: numba ``njit`` with IEEE semantics, cached on disk.

- No ``fastmath``: LLVM then never contracts ``a * b + c`` into an FMA, never reassociates a
  float sum and keeps subnormals, so each float32 operation in a kernel is one correctly
  rounded ``fl()`` of the contract, in the order written.
- ``error_model="numpy"``: a float division by zero gives +-inf or NaN as IEEE says, never
  Python's ZeroDivisionError.
- ``nogil``: kernels release the GIL, so other Python threads keep running.
- ``cache=True``, in a directory named after a digest of the kernel sources (this package and
  ``parity.numerics``, whose constants are compiled in). numba checks only a function's own
  file before reusing its cached code, and kernels here inline code from other files; a new
  digest means a new directory, so an edit anywhere recompiles everything. The directory sits
  under the first writable one of ``NUMBA_CACHE_DIR``, this package's ``__pycache__`` and
  ``$XDG_CACHE_HOME/parity`` (``~/.cache/parity``); with none writable (a read-only install
  and home) the kernels compile at every start, after one warning.

Whenever numba actually compiles (not when it loads cached code), one line on stderr says so
before the first wait of the process, and one at exit how long compiling took: the first
model, and every quant type or shape first met later, gets the notice
(``PARITY_COMPILE_NOTICE=0`` silences it).
"""

from __future__ import annotations

import atexit
import hashlib
import os
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numba

import parity.numerics

SOURCES = (*sorted(Path(__file__).parent.glob("*.py")), Path(parity.numerics.__file__))


def _digest() -> str:
    h = hashlib.sha256()
    for path in SOURCES:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def _cache_dir() -> str | None:
    """The first writable candidate directory for this digest's compiled kernels, or None."""
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    roots = [numba.config.CACHE_DIR, str(Path(__file__).parent / "__pycache__"), f"{xdg}/parity"]
    for root in filter(None, roots):
        path = os.path.join(root, f"parity-kernels-{_digest()}")
        try:
            os.makedirs(path, exist_ok=True)
            tempfile.TemporaryFile(dir=path).close()
        except OSError:
            continue
        return path
    warnings.warn(
        "no writable directory for the compiled cpu kernels (NUMBA_CACHE_DIR, the package's "
        "__pycache__, ~/.cache/parity); they compile at every start. Set NUMBA_CACHE_DIR to a "
        "writable directory to keep them.",
        stacklevel=2,
    )
    return None


CACHE_DIR = _cache_dir()


class _CompileNotice(numba.core.event.Listener):
    """Says on stderr, once a process, when numba starts compiling, and at exit how long all
    of it took (compiles nest: a kernel compiles the helpers it calls; only the outermost ones
    are timed)."""

    def __init__(self, stream=None) -> None:  # type: ignore[no-untyped-def]
        self.stream = stream
        self.depth = 0
        self.t0 = 0.0
        self.total = 0.0
        self.announced = False
        self.lock = threading.Lock()

    def _write(self, text: str) -> None:
        print(text, file=self.stream or sys.stderr, flush=True)

    def on_start(self, event: Any) -> None:
        with self.lock:
            self.depth += 1
            if self.depth == 1:
                self.t0 = time.perf_counter()
                if not self.announced:
                    self.announced = True
                    self._write("parity: compiling cpu kernels for what this run meets first "
                                "(20-30 s for a new model; later runs reuse them)")  # fmt: skip

    def on_end(self, event: Any) -> None:
        with self.lock:
            self.depth -= 1
            if self.depth == 0:
                self.total += time.perf_counter() - self.t0

    def report(self) -> None:
        if self.announced:
            self._write(f"parity: cpu kernels compiled in {self.total:.1f} s")


NOTICE = _CompileNotice()
if os.environ.get("PARITY_COMPILE_NOTICE", "1") != "0":  # read once, at import
    numba.core.event.register("numba:compile", NOTICE)
    atexit.register(NOTICE.report)


def kernel(parallel: bool = False, inline: bool = False) -> Callable[[Callable], Any]:
    """Decorator: ``numba.njit`` with the options above. ``parallel`` enables ``prange``;
    ``inline`` splices a small helper into its callers (no call overhead per row)."""
    options: dict[str, Any] = {"nogil": True, "parallel": parallel, "error_model": "numpy"}
    if inline:
        options["inline"] = "always"

    def wrap(fn: Callable) -> Any:
        if CACHE_DIR is None:
            return numba.njit(cache=False, **options)(fn)
        # numba places a function's cache when it is decorated: point it at our directory
        saved, numba.config.CACHE_DIR = numba.config.CACHE_DIR, CACHE_DIR
        try:
            return numba.njit(cache=True, **options)(fn)
        finally:
            numba.config.CACHE_DIR = saved

    return wrap
