"""A model file opened for running: the GGUF read, its architecture's spec, and every weight its
graphs read (the file's tensors as zero-copy views, plus the host RoPE tables)."""

from __future__ import annotations

import os
import types
from collections.abc import Mapping
from pathlib import Path

import attrs

from parity.arch.decoder import DecoderSpec, rope_weights
from parity.arch.metadata import decoder_spec
from parity.core.weights import WeightData
from parity.gguf.reader import read_gguf, reading


@attrs.frozen
class ModelFile:
    """A loaded model: the spec its graphs are built from (``spec.weights`` lists every weight,
    the RoPE tables included), those weights (views into one read-only memory map of the file,
    and the host tables) and all of the file's metadata."""

    path: Path
    version: int
    alignment: int
    spec: DecoderSpec
    weights: Mapping[str, WeightData] = attrs.field(repr=False)
    metadata: Mapping[str, object] = attrs.field(repr=False)


def read_model_file(path: str | os.PathLike) -> ModelFile:
    """Open a llama, qwen2 or gemma3 GGUF file without copying any weight.

    Raises ModelFileError for a missing, unreadable, malformed or unsupported file, and
    ModelError for an architecture parity does not build.
    """
    file = read_gguf(path)
    with reading(file.where):
        spec = decoder_spec(file)
        weights = {**file.tensors, **{w.name: w for w in rope_weights(spec)}}
    return ModelFile(
        path=file.path,
        version=file.header.version,
        alignment=file.header.alignment,
        spec=spec.with_weights(weights.values()),
        weights=types.MappingProxyType(weights),
        metadata=file.metadata,
    )
