"""Fuzzing the GGUF loader with seeded, deterministic mutations of (a) a tiny synthetic model's
file and (b) the real SmolLM2 header. Every case must load or raise ModelError (ModelFileError
included): never another exception, never a hang, never a large allocation."""

from __future__ import annotations

import contextlib
import os
import signal
import struct
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValueType

from parity.arch.model_file import read_model_file
from parity.arch.synthetic import synthetic_model, tiny_spec, write_model_gguf
from parity.core.dtypes import DType
from parity.errors import ModelError
from parity.gguf.reader import GGUFHeader, scan_header
from parity.gguf.writer import tiny_bpe_tokenizer

SEED = 1234
CASE_SECONDS = 2.0  # far above any honest case; catches hangs
TRACED_SECONDS = 10 * CASE_SECONDS  # tracemalloc slows a string-heavy parse about tenfold
PEAK_BYTES = 64 << 20  # traced Python/numpy allocations per case

U64_MAX = 2**64 - 1
# interesting values per kind of field, beyond those derived from the original value
SPECIAL = {
    "version": [0, 1, 2, 4, 0x03000000, 2**32 - 1],
    "count": [0, 1, 2**31, 2**32, 2**63, U64_MAX],
    "length": [0, 1, 2**32, 2**63, U64_MAX],
    "value type": [8, 9, 12, 13, 255, 2**32 - 1],
    "n_dims": [0, 1, 2, 4, 5, 2**32 - 1],
    "dim": [0, 1, 31, 250, 2**32, 2**63, U64_MAX],
    "ggml type": [0, 1, 4, 10, 26, 30, 99, 2**31, 2**32 - 1],
    "offset": [0, 1, 16, 2**40, 2**63, U64_MAX - 31],
}


def structural_fields(h: GGUFHeader) -> list[tuple[int, int, str]]:
    """(offset, size, kind) of every version, count, length, type, dim and offset field."""
    fields = [(4, 4, "version"), (8, 8, "count"), (16, 8, "count")]
    for key, e in h.entries.items():
        fields.append((e.offset, 8, "length"))
        at = e.offset + 8 + len(key.encode())
        fields.append((at, 4, "value type"))
        if e.type is GGUFValueType.ARRAY:
            fields += [(at + 4, 4, "value type"), (at + 8, 8, "count")]
            if e.item_type is GGUFValueType.STRING:
                fields.append((at + 16, 8, "length"))
        elif e.type is GGUFValueType.STRING:
            fields.append((at + 4, 8, "length"))
    for name, t in h.tensors.items():
        fields.append((t.info_offset, 8, "length"))
        at = t.info_offset + 8 + len(name.encode())
        fields.append((at, 4, "n_dims"))
        fields += [(at + 4 + 8 * d, 8, "dim") for d in range(len(t.dims))]
        at += 4 + 8 * len(t.dims)
        fields += [(at, 4, "ggml type"), (at + 4, 8, "offset")]
    return fields


def set_field(data: bytes, offset: int, size: int, value: int) -> bytes:
    out = bytearray(data)
    struct.pack_into("<Q" if size == 8 else "<I", out, offset, value % (1 << (8 * size)))
    return bytes(out)


def mutations(
    data: bytes, fields: list, rng: np.random.Generator, n_random: int, per_field: int = 0
) -> Iterator[tuple[str, bytes]]:
    """(label, mutated bytes): special values and values near the original in every field
    (all, or ``per_field`` of them picked at random), truncation at each field's start, middle
    and end (or one of those), then random truncations and byte and bit flips."""
    for offset, size, kind in fields:
        (orig,) = struct.unpack_from("<Q" if size == 8 else "<I", data, offset)
        values = sorted({*SPECIAL[kind], orig + 1, max(orig - 1, 0), orig * 2, len(data)})
        cuts = [offset, offset + size // 2, offset + size]
        if per_field:
            values = [values[j] for j in rng.choice(len(values), per_field, replace=False)]
            cuts = [cuts[rng.integers(3)]]
        for value in values:
            yield f"{kind}@{offset}={value}", set_field(data, offset, size, value)
        for cut in cuts:
            yield f"truncate@{cut}", data[:cut]
    for cut in rng.integers(1, len(data), n_random):
        yield f"truncate@{cut}", data[:cut]
    header_end = max(o + s for o, s, _ in fields)
    for _ in range(n_random):
        out = bytearray(data)
        for at in rng.integers(0, header_end, rng.integers(1, 5)):
            out[at] = rng.integers(0, 256)
        yield "bytes", bytes(out)
    for _ in range(n_random):
        offset, size, _ = fields[rng.integers(len(fields))]
        bit = int(rng.integers(8 * size))
        out = bytearray(data)
        out[offset + bit // 8] ^= 1 << (bit % 8)
        yield f"bit {bit}@{offset}", bytes(out)


class CaseTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    def expire(signum, frame):
        raise CaseTimeout(f"took more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_cases(
    path: Path, cases: list[tuple[str, bytes]], pad_to: int = 0, trace_every: int = 1
) -> dict[str, int]:
    """Load every case from ``path`` (sparse-extended to ``pad_to`` bytes when given), tracing
    allocations in every ``trace_every``-th case; returns how many loaded and were refused."""
    outcome = {"loaded": 0, "refused": 0}
    try:
        for i, (label, data) in enumerate(cases):
            path.write_bytes(data)
            if pad_to > len(data):
                os.truncate(path, pad_to)  # a sparse data region: no 98 MB copy per case
            traced = i % trace_every == 0
            if traced:
                tracemalloc.start()  # slows string-heavy parsing ~10x, hence the sampling
            start = time.perf_counter()
            try:
                with time_limit(TRACED_SECONDS if traced else CASE_SECONDS):
                    read_model_file(path)
                outcome["loaded"] += 1
            except ModelError:
                outcome["refused"] += 1
            except Exception as err:
                pytest.fail(f"case {label}: {type(err).__name__}: {err}")
            elapsed = time.perf_counter() - start
            if traced:
                peak = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
                assert peak < PEAK_BYTES, f"case {label}: allocated {peak} bytes"
            limit = TRACED_SECONDS if traced else CASE_SECONDS
            assert elapsed < limit, f"case {label}: took {elapsed:.2f} s"
    finally:
        tracemalloc.stop()
    return outcome


def test_fuzz_tiny_model(tmp_path):
    types = {"attn": DType.Q4_0, "attn_v": DType.Q5_0, "ffn": DType.Q4_1,
             "ffn_down": DType.Q8_0, "embd": DType.F16, "output": DType.BF16}  # fmt: skip
    spec = tiny_spec("qwen2", n_vocab=320, n_embd=64, n_head=2, n_head_kv=1, head_dim=32,
                     n_ff=64, n_layer=1, n_ctx_train=64)  # fmt: skip
    spec, weights = synthetic_model(spec, seed=0, types=types)
    path = write_model_gguf(
        tmp_path / "orig.gguf", spec, weights, tokenizer=tiny_bpe_tokenizer(320)
    )
    data = path.read_bytes()
    h = scan_header(memoryview(data), "tiny")
    cases = list(mutations(data, structural_fields(h), np.random.default_rng(SEED), 600))
    assert len(cases) > 3000
    outcome = run_cases(tmp_path / "case.gguf", cases, trace_every=3)
    assert outcome["loaded"] > 100 and outcome["refused"] > 2000, outcome


def test_fuzz_real_header(tmp_path, real_model):
    path = real_model("smollm2-135m")
    file = np.memmap(path, mode="r")
    h = scan_header(memoryview(file), str(path))
    data = file[: h.data_offset].tobytes()  # the header, 1.8 MB; the data stays behind
    del file
    rng = np.random.default_rng(SEED)
    fields = structural_fields(h)
    # every metadata field and a sample of tensor records, one value and one cut each: a case
    # that gets past the vocabulary costs a full header parse (~50 ms; ~0.7 s traced)
    first_tensor = min(t.info_offset for t in h.tensors.values())
    picked = [f for f in fields if f[0] < first_tensor]
    picked += [fields[i] for i in rng.choice(len(fields), 20, replace=False)]
    cases = list(mutations(data, sorted(set(picked)), rng, 15, per_field=1))
    assert len(cases) > 200
    size = path.stat().st_size
    # most cases see the whole (sparse) data region, some a truncated one
    whole = run_cases(tmp_path / "a.gguf", cases[::3] + cases[1::3], size, trace_every=40)
    cut = run_cases(tmp_path / "b.gguf", cases[2::3], size // 2, trace_every=40)
    assert whole["loaded"] > 0 and whole["refused"] + cut["refused"] > 150, (whole, cut)
