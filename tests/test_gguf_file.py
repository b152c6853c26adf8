"""GGUF loading: synthetic round trips in every weight type, the real models, and one test per
class of bad input (each a ModelFileError whose one-line message names the problem)."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from parity.arch.decoder import ROPE_WEIGHTS, build_decoder
from parity.arch.model_file import read_model_file
from parity.arch.params import GraphParams
from parity.arch.synthetic import synthetic_model, tiny_spec, write_model_gguf
from parity.core.dtypes import WEIGHT_TYPES, DType
from parity.core.weights import WeightData
from parity.errors import ModelError, ModelFileError
from parity.gguf.reader import GGUFHeader, scan_header
from parity.gguf.writer import tiny_bpe_tokenizer
from parity.quant.dequant import dequantize

MIX_KEYS = ("attn", "attn_v", "ffn", "ffn_down", "embd", "output")


def write_tiny(path: Path, arch: str = "llama", types=None, edit=None, **kw) -> Path:
    """A tiny synthetic model with a tokenizer; ``edit(weights)`` may change its tensors."""
    spec, weights = synthetic_model(tiny_spec(arch), seed=0, types=types)
    if edit is not None:
        edit(weights)
    return write_model_gguf(path, spec, weights, tokenizer=tiny_bpe_tokenizer(), **kw)


def header(path: Path) -> GGUFHeader:
    return scan_header(memoryview(path.read_bytes()), str(path))


def patch(path: Path, offset: int, fmt: str, value: object) -> None:
    data = bytearray(path.read_bytes())
    struct.pack_into(fmt, data, offset, value)
    path.write_bytes(data)


def value_at(h: GGUFHeader, key: str) -> int:
    """File offset of a metadata entry's value (after its key and value type)."""
    return h.entries[key].offset + 8 + len(key.encode()) + 4


def tensor_field(h: GGUFHeader, name: str, field: str) -> int:
    """File offset of one field of a tensor's record."""
    t = h.tensors[name]
    n_dims_at = t.info_offset + 8 + len(name.encode())
    type_at = n_dims_at + 4 + 8 * len(t.dims)
    return {"n_dims": n_dims_at, "dims": n_dims_at + 4, "type": type_at, "offset": type_at + 4}[
        field
    ]


def expect_error(path: Path, *fragments: str, exc: type = ModelFileError) -> str:
    with pytest.raises(exc) as info:
        read_model_file(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


# -- round trips -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", WEIGHT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_round_trip_every_weight_type(tmp_path, arch, dtype):
    spec, weights = synthetic_model(tiny_spec(arch), seed=1, types=dict.fromkeys(MIX_KEYS, dtype))
    path = write_model_gguf(tmp_path / "m.gguf", spec, weights, tokenizer=tiny_bpe_tokenizer())
    model = read_model_file(path)
    assert (model.version, model.alignment) == (3, 32)
    assert model.spec == spec and set(model.weights) == set(weights)
    for name, w in model.weights.items():
        assert (w.dtype, w.shape) == (weights[name].dtype, weights[name].shape), name
        assert np.array_equal(w.raw(), weights[name].raw()), name
        if w.dtype is DType.F32:
            assert w.data.dtype == np.float32 and w.data.shape == w.shape
        else:
            assert w.data.dtype == np.uint8 and w.data.ndim == 1
    graph = build_decoder(
        model.spec,
        GraphParams(n_tokens=2, n_ctx=8, n_out=1),
    )
    assert graph.outputs


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tied_and_untied_output(tmp_path, arch):
    tied = read_model_file(write_tiny(tmp_path / "t.gguf", arch, types={"output": None}))
    untied = read_model_file(write_tiny(tmp_path / "u.gguf", arch, types={"output": DType.Q8_0}))
    assert "output.weight" not in tied.weights
    assert untied.weights["output.weight"].shape == (512, 256)


def test_metadata_round_trip(tmp_path):
    extra = {
        "general.name": "tiny",
        "test.f64": np.float64(0.1),
        "test.i64s": np.array([-1, 2**40], np.int64),
        "test.bools": [True, False],
        "test.u8": np.uint8(7),
    }
    path = write_tiny(tmp_path / "m.gguf", metadata=extra, chat_template="{{ messages }}")
    meta = read_model_file(path).metadata
    tok = tiny_bpe_tokenizer()
    assert meta["general.architecture"] == "llama" and meta["general.name"] == "tiny"
    assert meta["tokenizer.ggml.tokens"] == tok["tokenizer.ggml.tokens"]
    assert meta["tokenizer.ggml.merges"] == tok["tokenizer.ggml.merges"]
    assert meta["tokenizer.ggml.token_type"].dtype == np.int32
    assert np.array_equal(meta["tokenizer.ggml.token_type"], tok["tokenizer.ggml.token_type"])
    assert meta["tokenizer.ggml.bos_token_id"] == 1 and meta["tokenizer.ggml.eos_token_id"] == 2
    assert meta["tokenizer.ggml.add_bos_token"] is False
    assert meta["tokenizer.chat_template"] == "{{ messages }}"
    assert meta["llama.attention.layer_norm_rms_epsilon"] == float(np.float32(1e-5))
    assert meta["test.f64"] == 0.1 and meta["test.u8"] == 7
    assert meta["test.i64s"].dtype == np.int64 and meta["test.i64s"].tolist() == [-1, 2**40]
    assert meta["test.bools"].dtype == np.bool_ and meta["test.bools"].tolist() == [True, False]


def test_tiny_tokenizer_shape():
    tok = tiny_bpe_tokenizer(512)
    tokens, merges = tok["tokenizer.ggml.tokens"], tok["tokenizer.ggml.merges"]
    assert len(tokens) == 512 == len(set(tokens))
    assert tokens[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert tok["tokenizer.ggml.token_type"][:4].tolist() == [3, 3, 3, 1]
    assert len(merges) == 512 - 3 - 256
    vocab = set(tokens)
    assert all(set(m.split(" ")) <= vocab and m.replace(" ", "") in vocab for m in merges)


def test_custom_alignment_and_version_2(tmp_path):
    path = write_tiny(tmp_path / "m.gguf", metadata={"general.alignment": 64})
    patch(path, 4, "<I", 2)
    model = read_model_file(path)
    assert (model.version, model.alignment) == (2, 64)
    assert all(t.offset % 64 == 0 for t in header(path).tensors.values())


def test_optional_llama_bias_is_kept(tmp_path):
    def add_bias(weights):
        bias = np.linspace(-1, 1, 256, dtype=np.float32)
        weights["blk.0.attn_q.bias"] = WeightData("blk.0.attn_q.bias", DType.F32, (256,), bias)

    model = read_model_file(write_tiny(tmp_path / "m.gguf", edit=add_bias))
    assert model.weights["blk.0.attn_q.bias"].data[-1] == 1.0


# -- the real models ---------------------------------------------------------------------------

REAL = {
    "smollm2-135m": dict(
        arch="llama", n_layer=30, n_embd=576, n_head=9, n_head_kv=3, head_dim=64, n_ff=1536,
        n_ctx_train=8192, rope_base=1e5, n_vocab=49152, rms_eps=1e-5, tied=True, biases=False,
    ),
    "qwen2.5-coder-0.5b": dict(
        arch="qwen2", n_layer=24, n_embd=896, n_head=14, n_head_kv=2, head_dim=64, n_ff=4864,
        n_ctx_train=32768, rope_base=1e6, n_vocab=151936, rms_eps=1e-6, tied=False, biases=True,
    ),
}  # fmt: skip


def file_map(data: np.ndarray) -> np.ndarray:
    """The array at the root of a view chain (the file's memory map, for a loaded weight)."""
    while isinstance(data.base, np.ndarray):
        data = data.base
    return data


@pytest.mark.parametrize("name", REAL)
def test_real_model(real_model, name):
    path = real_model(name)
    model = read_model_file(path)
    want = REAL[name]
    spec = model.spec
    for key in ("arch", "n_layer", "n_embd", "n_head", "n_head_kv", "head_dim", "n_ff"):
        assert getattr(spec, key) == want[key], key
    assert (spec.n_ctx_train, spec.n_vocab, spec.rope_base) == (
        want["n_ctx_train"], want["n_vocab"], want["rope_base"],
    )  # fmt: skip
    assert spec.rms_eps == float(np.float32(want["rms_eps"])) and spec.rot == 64
    assert ("output.weight" not in model.weights) == want["tied"]
    assert ("blk.0.attn_q.bias" in model.weights) == want["biases"]
    assert len(model.metadata["tokenizer.ggml.tokens"]) == spec.n_vocab
    assert isinstance(model.metadata["tokenizer.chat_template"], str)

    # every weight is a read-only view into one map of the whole file: nothing was copied
    root = file_map(model.weights["token_embd.weight"].data)
    assert isinstance(root, np.memmap) and root.size == path.stat().st_size
    for tensor, w in model.weights.items():
        assert not w.data.flags.writeable, tensor
        if tensor not in ROPE_WEIGHTS:  # the host-computed tables are the only other weights
            assert file_map(w.data) is root and np.shares_memory(w.data, root)
            assert not w.data.flags.owndata

    # one row per weight type dequantizes as gguf does, bit for bit
    by_type = {}
    for tensor, w in model.weights.items():
        if len(w.shape) == 2 and tensor not in ROPE_WEIGHTS:
            by_type.setdefault(w.dtype, w)
    assert len(by_type) == (2 if name.startswith("smollm2") else 4)
    for dtype, w in by_type.items():
        rows, cols = w.shape
        row = w.raw().reshape(rows, -1)[rows // 2]
        ours = dequantize(dtype, row, (1, cols)).reshape(-1)
        theirs = gguf.quants.dequantize(row, gguf.GGMLQuantizationType(dtype.value))
        assert np.array_equal(ours.view(np.uint32), theirs.astype(np.float32).view(np.uint32))


# -- bad files -----------------------------------------------------------------------------------


def test_missing_directory_empty_unreadable(tmp_path):
    expect_error(tmp_path / "nope.gguf", "does not exist")
    expect_error(tmp_path, "is a directory")
    empty = tmp_path / "empty.gguf"
    empty.touch()
    expect_error(empty, "is empty")
    if os.geteuid() != 0:  # root reads any file
        locked = write_tiny(tmp_path / "locked.gguf")
        locked.chmod(0)
        expect_error(locked, "cannot be read")


@pytest.fixture
def tiny(tmp_path) -> tuple[Path, GGUFHeader]:
    path = write_tiny(tmp_path / "m.gguf")
    return path, header(path)


def test_not_gguf_and_versions(tiny):
    path, _ = tiny
    patch(path, 0, "<4s", b"GGML")
    expect_error(path, "GGUF magic")
    patch(path, 0, "<4s", b"GGUF")
    for version, fragment in ((1, "version 1 is not supported"), (4, "version 4")):
        patch(path, 4, "<I", version)
        expect_error(path, fragment)
    patch(path, 4, ">I", 3)
    expect_error(path, "big-endian")


@pytest.mark.parametrize(
    ("where", "fmt", "value", "fragment"),
    [
        (lambda h: 8, "<Q", 2**40, "and 1099511627776 tensors, more than"),
        (lambda h: 16, "<Q", 2**62, "metadata entries"),
        (lambda h: 24, "<Q", 2**62, "the key of metadata entry 0"),
        (lambda h: value_at(h, "general.name"), "<Q", 2**63, "the value of metadata"),
        (lambda h: value_at(h, "tokenizer.ggml.tokens") + 4, "<Q", 2**60, "claims"),
        (lambda h: value_at(h, "general.quantization_version") - 4, "<I", 99, "not a GGUF value"),
        (lambda h: value_at(h, "tokenizer.ggml.token_type"), "<I", 77, "element type"),
        (lambda h: value_at(h, "tokenizer.ggml.token_type"), "<I", 9, "array of arrays"),
        (lambda h: value_at(h, "tokenizer.ggml.add_bos_token"), "<B", 7, "not 0 or 1"),
        (lambda h: h.entries["general.type"].offset + 8, "<B", 0xFF, "not valid UTF-8"),
        (
            lambda h: h.entries["tokenizer.ggml.eos_token_id"].offset + 8,
            "<27s",
            b"tokenizer.ggml.bos_token_id",
            "'tokenizer.ggml.bos_token_id' appears twice",
        ),
        (
            lambda h: h.entries["general.architecture"].offset + 8,
            "<20s",
            b"general.architecturX",
            "'general.architecture' is missing",
        ),
    ],
)
def test_bad_header(tiny, where, fmt, value, fragment):
    path, h = tiny
    patch(path, where(h), fmt, value)
    expect_error(path, fragment)


EMBD = "token_embd.weight"


@pytest.mark.parametrize(
    ("field", "fmt", "value", "fragment"),
    [
        ("n_dims", "<I", 0, "has 0 dimensions (GGUF allows 1 to 4)"),
        ("n_dims", "<I", 5, "has 5 dimensions"),
        ("dims", "<Q", 0, "zero dimension"),
        ("dims", "<Q", 250, "rows of 250 elements, not a whole number of Q8_0 blocks of 32"),
        ("type", "<I", 99, f"tensor '{EMBD}' has unknown ggml type 99 (parity supports F32,"),
        ("type", "<I", 10, f"tensor '{EMBD}' has type Q2_K, which parity does not support"),
        ("offset", "<Q", 2**40, f"tensor '{EMBD}' extends past the end of the file"),
    ],
)
def test_bad_tensor_record(tiny, field, fmt, value, fragment):
    path, h = tiny
    patch(path, tensor_field(h, EMBD, field), fmt, value)
    expect_error(path, fragment)


def test_huge_dims_and_misaligned_offsets(tiny):
    path, h = tiny
    data = path.read_bytes()
    patch(path, tensor_field(h, EMBD, "dims") + 8, "<Q", 2**62)
    expect_error(path, "more than the whole file")
    path.write_bytes(data)
    relative = h.tensors[EMBD].offset - h.data_offset
    patch(path, tensor_field(h, EMBD, "offset"), "<Q", relative + 16)
    expect_error(path, "not a multiple of the alignment 32")


def test_overlap_and_duplicate_tensors(tiny):
    path, h = tiny
    data = path.read_bytes()
    q, k = "blk.0.attn_q.weight", "blk.0.attn_k.weight"
    patch(path, tensor_field(h, k, "offset"), "<Q", h.tensors[q].offset - h.data_offset)
    expect_error(path, "overlap", q, k)
    path.write_bytes(data)
    patch(path, h.tensors[k].info_offset + 8, f"<{len(q)}s", q.encode())
    expect_error(path, f"tensor name '{q}' appears twice")


def test_truncated(tiny):
    path, h = tiny
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    expect_error(path, "extends past the end of the file", "download it again")
    path.write_bytes(data[: tensor_field(h, EMBD, "dims") + 3])
    expect_error(path, f"dimension 0 of tensor '{EMBD}'", "needs 8 bytes, but the file ends")
    path.write_bytes(data[: h.entries["tokenizer.ggml.token_type"].offset - 1])
    expect_error(path, "element 511 of metadata 'tokenizer.ggml.tokens' at byte", "file ends")
    path.write_bytes(data[:30])
    expect_error(path, "claims 24 metadata entries and 20 tensors, more than the 6 bytes")


def test_alignment_checks(tmp_path):
    path = write_tiny(tmp_path / "m.gguf", metadata={"general.alignment": 32})
    data = path.read_bytes()
    at = value_at(header(path), "general.alignment")
    patch(path, at, "<I", 48)
    expect_error(path, "'general.alignment' is 48, not a power of two")
    path.write_bytes(data)
    patch(path, at - 4, "<I", 5)  # UINT32 -> INT32
    expect_error(path, "'general.alignment' is INT32; GGUF requires UINT32")


@pytest.mark.parametrize(
    ("metadata", "fragment"),
    [
        ({"llama.feed_forward_length": None}, "'llama.feed_forward_length' is missing"),
        ({"llama.block_count": "two"}, "'llama.block_count' is STRING, expected an integer"),
        ({"llama.block_count": 10**6}, "holds only"),
        ({"llama.context_length": 2**30}, "more than parity's"),
        ({"llama.attention.head_count_kv": 3}, "not a multiple of 3 key/value heads"),
        ({"llama.rope.dimension_count": 63}, "must be even"),
        ({"llama.attention.layer_norm_rms_epsilon": 1e-5}, "not exactly a float32"),
        ({"llama.rope.scaling.type": "linear"}, "RoPE scaling 'linear' is not supported"),
        ({"llama.rope.scaling.factor": 2.0}, "RoPE scaling is not supported"),
        ({"llama.vocab_size": 1000}, "'llama.vocab_size' is 1000 but token_embd has 512 rows"),
        ({"tokenizer.ggml.tokens": ["a"] * 500}, "the tokenizer has 500 tokens"),
    ],
)
def test_bad_hyperparameters(tmp_path, metadata, fragment):
    expect_error(write_tiny(tmp_path / "m.gguf", metadata=metadata), fragment)


def test_accepted_no_op_rope_scaling(tmp_path):
    path = write_tiny(
        tmp_path / "m.gguf",
        metadata={"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 1.0},
    )
    assert read_model_file(path).spec.arch == "llama"


def test_unsupported_architecture(tiny):
    path, h = tiny
    patch(path, value_at(h, "general.architecture") + 8, "<5s", b"gemma")
    message = expect_error(path, "architecture 'gemma' is not supported", exc=ModelError)
    assert "llama, qwen2" in message


def _drop(*names):
    def edit(weights):
        for name in names:
            del weights[name]

    return edit


def _replace(name, dtype, shape):
    def edit(weights):
        rng = np.random.default_rng(0)
        data = rng.integers(0, 256, dtype.nbytes(int(np.prod(shape))), dtype=np.uint8)
        weights[name] = WeightData(name, dtype, shape, data)

    return edit


@pytest.mark.parametrize(
    ("arch", "edit", "fragments"),
    [
        ("llama", _drop("blk.1.ffn_up.weight", EMBD), ["blk.1.ffn_up.weight is missing", EMBD]),
        (
            "llama",
            _replace("blk.0.attn_k.weight", DType.Q4_1, (256, 256)),
            ["blk.0.attn_k.weight is Q4_1 [256, 256], expected a weight type [128, 256]"],
        ),
        (
            "llama",
            _replace("blk.0.attn_norm.weight", DType.F16, (256,)),
            ["blk.0.attn_norm.weight is F16 [256], expected F32 [256]"],
        ),
        ("qwen2", _drop("blk.1.attn_v.bias"), ["blk.1.attn_v.bias is missing"]),
        ("llama", _replace("rope_freqs.weight", DType.F32, (32,)), ["rope_freqs.weight is not"]),
    ],
)
def test_tensors_that_do_not_fit_the_graph(tmp_path, arch, edit, fragments):
    path = write_tiny(tmp_path / "m.gguf", arch, edit=edit)
    expect_error(path, f"do not fit parity's {arch} graph", *fragments)
