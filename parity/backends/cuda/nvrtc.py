"""CUDA C compiled at run time with NVRTC, and kept on disk.

Options are the numeric contract's (docs/numerics.md): ``--fmad=false`` so no ``a*b + c`` is
contracted, no fast-math, divisions and square roots correctly rounded, subnormals kept. The
machine code is for the GPU's own architecture (``sm_80`` and newer).

A compiled module is cached on disk under a key made of everything that decides its bits: the
source, the kernel instantiations asked for, the architecture, the options and the NVRTC
version. A second run loads the cubin in milliseconds; the first says on stderr how long the
compile took. Compiling happens when a backend prepares a split, never inside a step or a
capture.

Works without a GPU (NVRTC is a library), which is how the kernels' sources are checked on
machines that have none.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import attrs

from parity.errors import BackendError

OPTIONS = (
    "--fmad=false",
    "--ftz=false",
    "--prec-div=true",
    "--prec-sqrt=true",
    "-std=c++17",
    "--device-as-default-execution-space",
)
CACHE_ENV = "PARITY_KERNEL_CACHE"


@attrs.frozen
class Module:
    """A compiled module: its cubin and the mangled name of each instantiation asked for."""

    cubin: bytes = attrs.field(repr=False)
    names: dict[str, str]  # name expression -> lowered (mangled) name
    seconds: float = 0.0  # time spent compiling (0 when it came from the cache)
    log: str = ""


def default_cache_dir(env: os._Environ | dict | None = None) -> Path:
    env = os.environ if env is None else env
    if env.get(CACHE_ENV):
        return Path(env[CACHE_ENV])
    base = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "parity" / "kernels"


def _check(result: tuple, what: str) -> tuple:
    from cuda.bindings import nvrtc

    status, *values = result
    if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, message = nvrtc.nvrtcGetErrorString(status)
        raise BackendError(f"NVRTC failed at {what}: {message.decode()}")
    return tuple(values)


def nvrtc_version() -> tuple[int, int]:
    from cuda.bindings import nvrtc

    major, minor = _check(nvrtc.nvrtcVersion(), "nvrtcVersion")
    return int(major), int(minor)


class Compiler:
    """Compiles CUDA C for one architecture (``sm_90``), through a disk cache."""

    def __init__(self, arch: str, *, cache_dir: Path | None = None, notice: bool = True) -> None:
        self.arch = arch
        self.cache_dir = default_cache_dir() if cache_dir is None else Path(cache_dir)
        self.notice = notice
        self.version = nvrtc_version()
        self.options = (f"--gpu-architecture={arch}", *OPTIONS)

    def key(self, source: str, names: Sequence[str], headers: dict[str, str]) -> str:
        h = hashlib.sha256()
        for part in (
            source,
            *names,
            *(f"{k}\0{v}" for k, v in sorted(headers.items())),
            *self.options,
            "nvrtc {}.{}".format(*self.version),
        ):
            h.update(part.encode())
            h.update(b"\0\1")
        return h.hexdigest()

    def compile(
        self,
        name: str,
        source: str,
        names: Sequence[str],
        headers: dict[str, str] | None = None,
    ) -> Module:
        """The module built from ``source`` with the kernel instantiations ``names`` (name
        expressions such as ``gemv<3, 8>``), from the cache when it holds it."""
        headers = dict(headers or {})
        names = list(dict.fromkeys(names))
        digest = self.key(source, names, headers)
        cached = self._load(digest)
        if cached is not None:
            return cached
        return self._build(digest, name, source, names, headers)

    def cached(
        self, source: str, names: Sequence[str], headers: dict[str, str] | None = None
    ) -> bool:
        """Is this module in the disk cache already?"""
        digest = self.key(source, list(dict.fromkeys(names)), dict(headers or {}))
        return self._paths(digest)[1].exists()

    def _build(
        self, digest: str, name: str, source: str, names: list[str], headers: dict[str, str]
    ) -> Module:
        start = time.perf_counter()
        if self.notice:
            print(
                f"parity: compiling CUDA kernels ({name}, {len(names)} instantiations) for "
                f"{self.arch}; this happens once, the result is cached in {self.cache_dir}",
                file=sys.stderr,
                flush=True,
            )
        cubin, lowered, log = self._compile(name, source, names, headers)
        seconds = time.perf_counter() - start
        if self.notice:
            print(f"parity: compiled {name} in {seconds:.1f} s", file=sys.stderr, flush=True)
        module = Module(cubin, lowered, seconds, log)
        self._store(digest, module)
        return module

    def _compile(
        self, name: str, source: str, names: list[str], headers: dict[str, str]
    ) -> tuple[bytes, dict[str, str], str]:
        from cuda.bindings import nvrtc

        (program,) = _check(
            nvrtc.nvrtcCreateProgram(
                source.encode(),
                f"{name}.cu".encode(),
                len(headers),
                [v.encode() for v in headers.values()],
                [k.encode() for k in headers],
            ),
            "nvrtcCreateProgram",
        )
        try:
            for expression in names:
                _check(
                    nvrtc.nvrtcAddNameExpression(program, expression.encode()),
                    f"nvrtcAddNameExpression({expression})",
                )
            options = [o.encode() for o in self.options]
            status, *_ = nvrtc.nvrtcCompileProgram(program, len(options), options)
            log = self._log(program)
            if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
                raise BackendError(f"NVRTC could not compile {name}.cu for {self.arch}:\n{log}")
            lowered = {}
            for expression in names:
                (mangled,) = _check(
                    nvrtc.nvrtcGetLoweredName(program, expression.encode()),
                    f"nvrtcGetLoweredName({expression})",
                )
                lowered[expression] = mangled.decode()
            (size,) = _check(nvrtc.nvrtcGetCUBINSize(program), "nvrtcGetCUBINSize")
            cubin = bytearray(size)  # NVRTC writes into it: never a bytes object (see _log)
            _check(nvrtc.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
            return bytes(cubin), lowered, log
        finally:
            nvrtc.nvrtcDestroyProgram(program)

    @staticmethod
    def _log(program) -> str:
        from cuda.bindings import nvrtc

        (size,) = _check(nvrtc.nvrtcGetProgramLogSize(program), "nvrtcGetProgramLogSize")
        # a buffer of our own: an empty log is one byte, and b" " * 1 is the interpreter's
        # shared b" ", which NVRTC's NUL would turn into b"\0" for the whole process
        buffer = bytearray(size)
        _check(nvrtc.nvrtcGetProgramLog(program, buffer), "nvrtcGetProgramLog")
        return bytes(buffer).rstrip(b"\0 ").decode(errors="replace")

    # -- the disk cache ---------------------------------------------------------------------

    def _paths(self, digest: str) -> tuple[Path, Path]:
        return self.cache_dir / f"{digest}.cubin", self.cache_dir / f"{digest}.json"

    def _load(self, digest: str) -> Module | None:
        cubin_path, meta_path = self._paths(digest)
        try:
            meta = json.loads(meta_path.read_text())
            cubin = cubin_path.read_bytes()
        except (OSError, ValueError):
            return None
        if hashlib.sha256(cubin).hexdigest() != meta.get("sha256"):
            return None  # a torn or damaged entry: compile again
        return Module(cubin, dict(meta["names"]))

    def _store(self, digest: str, module: Module) -> None:
        cubin_path, meta_path = self._paths(digest)
        meta = {"names": module.names, "sha256": hashlib.sha256(module.cubin).hexdigest()}
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            for path, data in ((cubin_path, module.cubin), (meta_path, json.dumps(meta).encode())):
                fd, tmp = tempfile.mkstemp(dir=self.cache_dir, prefix=".tmp-")
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)  # atomic: a reader sees the whole entry or none
        except OSError as e:
            print(
                f"parity: could not cache compiled kernels in {self.cache_dir}: {e}",
                file=sys.stderr,
            )
