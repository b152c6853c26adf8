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
"""

from __future__ import annotations

import hashlib
import os
import tempfile
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


def cache_is_warm() -> bool:
    """Whether compiled kernels are already on disk (else the first run compiles them)."""
    return CACHE_DIR is not None and any(Path(CACHE_DIR).rglob("*.nbi"))


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
