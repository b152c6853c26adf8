"""Reading a GGUF file: a bounded scan of the header, and the tensors as zero-copy views into one
read-only memory map. What the metadata means for a model is ``parity.arch``'s business.

The scan checks every length and count against the bytes left in the file before it reads or
allocates anything in proportion to it, so a truncated, corrupt or hostile file costs at most
one pass over its own header and ends in a ModelFileError that says what is wrong.
"""

from __future__ import annotations

import contextlib
import math
import os
import struct
import types
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import NoReturn

import attrs
import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLQuantizationType,
    GGUFValueType,
)

from parity.core.dtypes import WEIGHT_TYPES, DType
from parity.core.weights import WeightData
from parity.errors import ModelFileError

SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4
CORRUPT = "the file is truncated or corrupt — download it again"
UNSUPPORTED_TYPES = "use a GGUF quantized to types parity supports (e.g. Q4_K_M, Q8_0)"

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
V = GGUFValueType
# scalar value types: (struct format, numpy dtype of an array of them)
_SCALARS = {
    V.UINT8: ("<B", "<u1"), V.INT8: ("<b", "<i1"), V.UINT16: ("<H", "<u2"),
    V.INT16: ("<h", "<i2"), V.UINT32: ("<I", "<u4"), V.INT32: ("<i", "<i4"),
    V.FLOAT32: ("<f", "<f4"), V.BOOL: ("<B", "<u1"), V.UINT64: ("<Q", "<u8"),
    V.INT64: ("<q", "<i8"), V.FLOAT64: ("<d", "<f8"),
}  # fmt: skip
_STRUCTS = {t: struct.Struct(fmt) for t, (fmt, _) in _SCALARS.items()}
_SUPPORTED = frozenset(t.value for t in WEIGHT_TYPES)  # ggml type numbers parity reads
INT_TYPES = frozenset({V.UINT8, V.INT8, V.UINT16, V.INT16, V.UINT32, V.INT32, V.UINT64, V.INT64})
FLOAT_TYPES = frozenset({V.FLOAT32, V.FLOAT64})
# fewest bytes one entry can take: key length + 1-byte key + value type + 1-byte value
_MIN_KV_BYTES = 8 + 1 + 4 + 1
# fewest bytes one tensor info can take: name length + 1-byte name + n_dims + 1 dim + type + offset
_MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 8 + 4 + 8


@attrs.frozen
class MetadataEntry:
    """One key/value pair as stored: ``offset`` is where the entry (its key's length) starts;
    ``item_type`` is the element type of an ARRAY."""

    offset: int
    type: GGUFValueType
    value: object
    item_type: GGUFValueType | None = None


@attrs.frozen
class TensorInfo:
    """One tensor's record: ``dims`` in GGUF order (contiguous dim first), ``offset`` the
    absolute file offset of its data, ``info_offset`` where its record starts in the header."""

    name: str
    ggml_type: GGMLQuantizationType
    dims: tuple[int, ...]
    offset: int
    nbytes: int
    info_offset: int

    @property
    def dtype(self) -> DType:
        return DType(self.ggml_type.value)

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy order (rows, cols): GGUF's dims reversed."""
        return self.dims[::-1]


@attrs.frozen
class GGUFHeader:
    """Everything before the tensor data, validated."""

    version: int
    alignment: int
    data_offset: int
    entries: Mapping[str, MetadataEntry]
    tensors: Mapping[str, TensorInfo]


@attrs.frozen
class GGUFFile:
    """A GGUF file: its validated header, its metadata (scalars as int/float/bool/str, string
    arrays as lists, numeric arrays as read-only numpy views of the map) and its tensors as
    views into one read-only memory map of the file (never copies)."""

    path: Path
    header: GGUFHeader = attrs.field(repr=False)
    metadata: Mapping[str, object] = attrs.field(repr=False)
    tensors: Mapping[str, WeightData] = attrs.field(repr=False)

    @property
    def where(self) -> str:
        """How messages name the file."""
        return f"model file {self.path}"


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Open a GGUF file without copying any tensor; ModelFileError for a missing, unreadable,
    malformed or unsupported file (one line that says what is wrong)."""
    path = Path(path)
    where = f"model file {path}"
    mm = _map_file(path, where)
    with reading(where):
        header = scan_header(memoryview(mm), where)
        tensors = _weights(mm, header)
    return GGUFFile(
        path=path,
        header=header,
        metadata=types.MappingProxyType({k: e.value for k, e in header.entries.items()}),
        tensors=types.MappingProxyType(tensors),
    )


@contextlib.contextmanager
def reading(where: str) -> Iterator[None]:
    """Turn what a check missed into one ModelFileError line, never a traceback."""
    try:
        yield
    except (ValueError, struct.error, OverflowError, IndexError) as err:
        raise ModelFileError(f"{where}: cannot be read ({err}); {CORRUPT}") from err


def _map_file(path: Path, where: str) -> np.memmap:
    try:
        if not path.exists():
            raise ModelFileError(f"{where} does not exist; check the path, or pull the model")
        if path.is_dir():
            raise ModelFileError(f"{where} is a directory; give the path of the .gguf file in it")
        if path.stat().st_size == 0:
            raise ModelFileError(f"{where} is empty (0 bytes); {CORRUPT}")
        return np.memmap(path, dtype=np.uint8, mode="r")
    except OSError as err:
        raise ModelFileError(
            f"{where} cannot be read ({err.strerror or err}); check that it is a readable file"
        ) from err


# -- the header scan ---------------------------------------------------------------------------


class _Scanner:
    """Reads a GGUF header front to back, checking every length against the bytes left."""

    def __init__(self, buf: memoryview, where: str) -> None:
        self.buf = buf
        self.size = len(buf)
        self.pos = 0
        self.where = where

    def fail(self, problem: str, advice: str = CORRUPT) -> NoReturn:
        raise ModelFileError(f"{self.where}: {problem}; {advice}")

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            self.fail(
                f"{what} at byte {self.pos} needs {n} bytes, but the file ends at byte {self.size}"
            )

    def unpack(self, st: struct.Struct, what: str) -> int | float:
        self.need(st.size, what)
        (value,) = st.unpack_from(self.buf, self.pos)
        self.pos += st.size
        return value

    def string(self, what: str) -> str:
        n = self.unpack(_U64, f"the length of {what}")
        self.need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} is not valid UTF-8")

    def value_type(self, what: str) -> GGUFValueType:
        raw = self.unpack(_U32, what)
        try:
            return GGUFValueType(raw)
        except ValueError:
            self.fail(f"{what} is {raw}, which is not a GGUF value type (0..12)")

    def value(self, vtype: GGUFValueType, key: str) -> tuple[object, GGUFValueType | None]:
        what = f"the value of metadata {key!r}"
        if vtype is V.STRING:
            return self.string(what), None
        if vtype is not V.ARRAY:
            value = self.unpack(_STRUCTS[vtype], what)
            if vtype is V.BOOL:
                if value > 1:
                    self.fail(f"metadata {key!r} is a bool stored as {value}, not 0 or 1")
                return bool(value), None
            return value, None
        item = self.value_type(f"the element type of metadata {key!r}")
        if item is V.ARRAY:
            self.fail(
                f"metadata {key!r} is an array of arrays, which GGUF readers (llama.cpp "
                "included) do not support"
            )
        count = self.unpack(_U64, f"the length of metadata {key!r}")
        item_bytes = 8 if item is V.STRING else _STRUCTS[item].size  # a string: its length
        if count * item_bytes > self.size - self.pos:
            self.fail(
                f"metadata {key!r} claims {count} {item.name} elements, more than the "
                f"{self.size - self.pos} bytes left in the file can hold"
            )
        if item is V.STRING:
            return self.strings(count, key), item
        array = np.frombuffer(self.buf, _SCALARS[item][1], count, offset=self.pos)
        self.pos += count * item_bytes
        if item is V.BOOL:
            if count and array.max() > 1:
                self.fail(f"metadata {key!r} is a bool array holding values other than 0 and 1")
            array = array.view(np.bool_)
        return array, item

    def strings(self, count: int, key: str) -> list[str]:
        # the hot loop of a load: a vocabulary and its merges are ~10^5 strings each
        buf, pos, size, unpack = self.buf, self.pos, self.size, _U64.unpack_from
        out: list[str] = []
        append = out.append
        for i in range(count):
            if size - pos < 8:
                self.pos = pos
                self.need(8, f"the length of element {i} of metadata {key!r}")
            (n,) = unpack(buf, pos)
            pos += 8
            if n > size - pos:
                self.pos = pos
                self.need(n, f"element {i} of metadata {key!r}")
            try:
                append(str(buf[pos : pos + n], "utf-8"))
            except UnicodeDecodeError:
                self.fail(f"element {i} of metadata {key!r} is not valid UTF-8")
            pos += n
        self.pos = pos
        return out


def scan_header(buf: memoryview, where: str) -> GGUFHeader:
    """Parse and validate a GGUF header in ``buf`` (the whole file); ``where`` names the file
    in messages. Tensor records are checked for type, shape, alignment and data range."""
    s = _Scanner(buf, where)
    not_gguf = "is it a GGUF model file? parity reads .gguf files"
    if s.size < 4 or _U32.unpack_from(buf, 0)[0] != GGUF_MAGIC:
        s.fail(f"does not start with the GGUF magic (found {bytes(buf[:4])!r})", not_gguf)
    s.pos = 4
    version = s.unpack(_U32, "the GGUF version")
    if version not in SUPPORTED_VERSIONS:
        convert = "convert the model with a current llama.cpp (convert_hf_to_gguf.py)"
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        if swapped in SUPPORTED_VERSIONS:
            s.fail("is a big-endian GGUF file, which parity does not read", convert)
        s.fail(f"GGUF version {version} is not supported (parity reads versions 2 and 3)", convert)
    n_tensors = s.unpack(_U64, "the tensor count")
    n_kv = s.unpack(_U64, "the metadata count")
    left = s.size - s.pos
    if n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES > left:
        s.fail(
            f"claims {n_kv} metadata entries and {n_tensors} tensors, more than the "
            f"{left} bytes after its first {s.pos} can hold"
        )

    entries: dict[str, MetadataEntry] = {}
    for i in range(n_kv):
        start = s.pos
        key = s.string(f"the key of metadata entry {i}")
        if not key:
            s.fail(f"metadata entry {i} has an empty key")
        if key in entries:
            s.fail(f"metadata key {key!r} appears twice")
        vtype = s.value_type(f"the value type of metadata {key!r}")
        value, item = s.value(vtype, key)
        entries[key] = MetadataEntry(start, vtype, value, item)
    alignment = _alignment(entries, s)

    records = []
    names: set[str] = set()
    for i in range(n_tensors):
        start = s.pos
        name = s.string(f"the name of tensor {i}")
        if not name:
            s.fail(f"tensor {i} has an empty name")
        if name in names:
            s.fail(f"tensor name {name!r} appears twice")
        names.add(name)
        n_dims = s.unpack(_U32, f"the dimension count of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            s.fail(f"tensor {name!r} has {n_dims} dimensions (GGUF allows 1 to {MAX_DIMS})")
        dims = tuple(s.unpack(_U64, f"dimension {d} of tensor {name!r}") for d in range(n_dims))
        if 0 in dims:
            s.fail(f"tensor {name!r} has a zero dimension {list(dims)}")
        ggml_type = _tensor_type(s.unpack(_U32, f"the type of tensor {name!r}"), name, s)
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        if dims[0] % block:
            s.fail(
                f"tensor {name!r} has rows of {dims[0]} elements, not a whole number of "
                f"{ggml_type.name} blocks of {block}"
            )
        nbytes = math.prod(dims) // block * type_size
        if nbytes > s.size:
            s.fail(
                f"tensor {name!r} of dims {list(dims)} would take {nbytes} bytes, more than "
                f"the whole file ({s.size} bytes)"
            )
        offset = s.unpack(_U64, f"the data offset of tensor {name!r}")
        if offset % alignment:
            s.fail(
                f"tensor {name!r} starts at data offset {offset}, not a multiple of the "
                f"alignment {alignment}"
            )
        records.append((name, ggml_type, dims, offset, nbytes, start))

    data_offset = -(-s.pos // alignment) * alignment
    tensors = {
        name: TensorInfo(name, ggml_type, dims, data_offset + offset, nbytes, start)
        for name, ggml_type, dims, offset, nbytes, start in records
    }
    _check_ranges(tensors.values(), s)
    return GGUFHeader(
        version,
        alignment,
        data_offset,
        types.MappingProxyType(entries),
        types.MappingProxyType(tensors),
    )


def _alignment(entries: Mapping[str, MetadataEntry], s: _Scanner) -> int:
    entry = entries.get("general.alignment")
    if entry is None:
        return GGUF_DEFAULT_ALIGNMENT
    if entry.type is not V.UINT32:
        s.fail(f"metadata 'general.alignment' is {entry.type.name}; GGUF requires UINT32")
    alignment = int(entry.value)
    if alignment == 0 or alignment & (alignment - 1):
        s.fail(f"metadata 'general.alignment' is {alignment}, not a power of two")
    return alignment


def _tensor_type(raw: int, name: str, s: _Scanner) -> GGMLQuantizationType:
    supported = ", ".join(t.name for t in WEIGHT_TYPES)
    try:
        ggml_type = GGMLQuantizationType(raw)
    except ValueError:
        s.fail(f"tensor {name!r} has unknown ggml type {raw} (parity supports {supported})")
    if ggml_type.value not in _SUPPORTED:
        s.fail(
            f"tensor {name!r} has type {ggml_type.name}, which parity does not support "
            f"(supported: {supported})",
            UNSUPPORTED_TYPES,
        )
    return ggml_type


def _check_ranges(tensors: Iterable[TensorInfo], s: _Scanner) -> None:
    """Every tensor's bytes lie inside the file, and no two tensors share a byte."""
    previous: TensorInfo | None = None
    for t in sorted(tensors, key=lambda t: t.offset):
        end = t.offset + t.nbytes
        if end > s.size:
            s.fail(
                f"tensor {t.name!r} extends past the end of the file (needs bytes "
                f"{t.offset}..{end}, the file has {s.size})"
            )
        if previous is not None and t.offset < previous.offset + previous.nbytes:
            s.fail(
                f"tensors {previous.name!r} (bytes {previous.offset}.."
                f"{previous.offset + previous.nbytes}) and {t.name!r} (bytes {t.offset}..{end}) "
                "overlap"
            )
        previous = t


# -- metadata ----------------------------------------------------------------------------------


class MetadataReader:
    """Typed reads of a header's metadata, each failure a ModelFileError naming the key."""

    def __init__(self, header: GGUFHeader, where: str) -> None:
        self.entries = header.entries
        self.where = where

    def fail(self, problem: str, advice: str = CORRUPT) -> NoReturn:
        raise ModelFileError(f"{self.where}: {problem}; {advice}")

    def get(self, key: str, kinds: frozenset, expected: str, default: object = None) -> object:
        entry = self.entries.get(key)
        if entry is None:
            if default is None:
                self.fail(f"metadata {key!r} is missing", "the file is not a complete model")
            return default
        if entry.type not in kinds:
            self.fail(f"metadata {key!r} is {entry.type.name}, expected {expected}")
        return entry.value

    def count(self, key: str, default: int | None = None) -> int:
        value = int(self.get(key, INT_TYPES, "an integer", default))
        if value < 1:
            self.fail(f"metadata {key!r} is {value}, expected a positive integer")
        return value

    def positive(self, key: str, default: float | None = None) -> float:
        value = float(self.get(key, FLOAT_TYPES, "a float", default))
        if not (math.isfinite(value) and value > 0):
            self.fail(f"metadata {key!r} is {value}, expected a positive finite float")
        return value

    def string(self, key: str, default: str | None = None) -> str:
        return str(self.get(key, frozenset({V.STRING}), "a string", default))


def _weights(mm: np.memmap, header: GGUFHeader) -> dict[str, WeightData]:
    """Views of the mapped bytes: F32 as float32 of the weight's shape, others as flat uint8
    (the layout synthetic models use)."""
    weights = {}
    for t in header.tensors.values():
        data = mm[t.offset : t.offset + t.nbytes]
        if t.dtype is DType.F32:
            data = data.view("<f4").reshape(t.shape)
        weights[t.name] = WeightData(t.name, t.dtype, t.shape, data)
    return weights
