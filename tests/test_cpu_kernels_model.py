"""Whole models on the cpu backend: numba and numpy kernels give the same bits for prefill and
decode, on any thread count; how the kernels and threads are chosen; zero-copy weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from parity.arch.decoder import DecoderGraphs, graph_inputs
from parity.arch.model_file import read_model_file
from parity.arch.params import GraphParams
from parity.arch.synthetic import synthetic_model, tiny_spec
from parity.backends.cpu import kernel_choice
from parity.backends.cpu.backend import CpuBackend
from parity.backends.cpu.jit.ops import PackedWeight, pack_weight
from parity.core.backend import Device
from parity.core.config import load_config
from parity.core.runtime import Runtime
from parity.core.selection import make_backends
from parity.errors import ConfigError
from parity.quant import PreparedWeight

TOKENS = np.array([7, 300, 42, 511, 0, 9, 128, 3, 77], np.int32)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    return synthetic_model(tiny_spec(request.param), seed=21)


def run_sequence(spec, weights, backend: CpuBackend) -> np.ndarray:
    """Logits of a 6-token prefill, then 3 decode steps."""
    graphs = DecoderGraphs(spec)
    rt = Runtime([backend], weights)
    pre = graphs(GraphParams(n_tokens=6, n_ctx=64))
    rows = [rt.run(pre, graph_inputs(TOKENS[:6], 0))[pre.outputs[0]]]
    step = graphs(GraphParams(n_tokens=1, n_ctx=64))
    for p in range(6, len(TOKENS)):
        rows.append(rt.run(step, graph_inputs(TOKENS[p : p + 1], p))[step.outputs[0]])
    return np.concatenate(rows)


def test_numba_and_numpy_models_agree_bitwise(model):
    spec, weights = model
    want = run_sequence(spec, weights, CpuBackend(Device("cpu"), kernels="numpy"))
    for threads in (1, 2):
        backend = CpuBackend(Device("cpu"), kernels="numba", threads=threads)
        got = run_sequence(spec, weights, backend)
        assert got.tobytes() == want.tobytes(), f"threads={threads}"


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_real_models_agree_bitwise(real_model, name):
    """The real files' weights (every scale value they hold), prefill and decode."""
    file = read_model_file(real_model(name))
    spec, weights = file.spec, file.weights
    want = run_sequence(spec, weights, CpuBackend(Device("cpu"), kernels="numpy"))
    got = run_sequence(spec, weights, CpuBackend(Device("cpu"), kernels="numba"))
    assert got.tobytes() == want.tobytes()


def test_numba_backend_reads_weights_where_they_lie(model):
    spec, weights = model
    backend = CpuBackend(Device("cpu"), kernels="numba")
    run_sequence(spec, weights, backend)
    packed = [v for (_, form), v in backend._forms.items() if form == "packed"]
    assert packed and all(isinstance(w, PackedWeight) for w in packed)
    assert not any(isinstance(v, PreparedWeight) for v in backend._forms.values())
    for w in packed:
        assert np.shares_memory(w.raw, weights[_name_of(backend, w)].data)


def _name_of(backend: CpuBackend, packed: PackedWeight) -> str:
    return next(name for (name, form), v in backend._forms.items() if v is packed)


def test_pack_weight_is_zero_copy_and_checks_shape():
    _, weights = synthetic_model(tiny_spec("llama"), seed=1)
    w = weights["blk.0.attn_q.weight"]
    assert np.shares_memory(pack_weight(w).raw, w.data)
    with pytest.raises(ValueError, match="must be 2-D"):
        pack_weight(weights["blk.0.attn_norm.weight"])


def test_kernel_choice_precedence(monkeypatch):
    env = {kernel_choice.ENV: "numpy"}
    assert kernel_choice.choose_mode(None, {}, {}) == "numba"  # numba imports here
    assert kernel_choice.choose_mode(None, {"kernels": "numba"}, env) == "numpy"
    assert kernel_choice.choose_mode("numba", {"kernels": "numpy"}, env) == "numba"
    assert kernel_choice.choose_mode(None, {"kernels": "numpy"}, {kernel_choice.ENV: ""}) == "numpy"
    choices = "use one of numba, numpy, definition"
    with pytest.raises(ConfigError, match=f"PARITY_CPU_KERNELS='fast': {choices}"):
        kernel_choice.choose_mode(None, {}, {kernel_choice.ENV: "fast"})
    monkeypatch.setenv(kernel_choice.ENV, "numpy")
    assert CpuBackend(Device("cpu")).kernel_mode == "numpy"
    assert CpuBackend(Device("cpu"), kernels="numba").kernel_mode == "numba"


def test_numba_that_cannot_load(monkeypatch):
    monkeypatch.setattr(kernel_choice, "numba_problem", lambda: "ImportError: no numba")
    with pytest.warns(UserWarning, match="runs its numpy kernels: numba cannot load"):
        assert kernel_choice.choose_mode(None, {}, {}) == "numpy"
    with pytest.raises(ConfigError, match="asks for the numba cpu kernels, but they cannot load"):
        kernel_choice.choose_mode("numba", {}, {})


def test_threads_option():
    import numba

    most = numba.config.NUMBA_NUM_THREADS
    assert CpuBackend(Device("cpu"), kernels="numba").threads == most
    assert CpuBackend(Device("cpu"), kernels="numba", threads=1).threads == 1
    for bad in (0, most + 1, 1.5, True):
        with pytest.raises(ConfigError, match=r"threads=.* \(argument\): use a whole number"):
            CpuBackend(Device("cpu"), kernels="numba", threads=bad)


def test_config_file_options_reach_the_backend(tmp_path: Path, registry):
    path = tmp_path / "parity.toml"
    path.write_text('backend = "cpu"\n[backends.cpu]\nkernels = "numpy"\nthreads = 1\n')
    (cpu,) = make_backends(load_config(path=path, env={}), registry)
    assert (cpu.kernel_mode, cpu.threads) == ("numpy", 1)
    path.write_text('backend = "cpu"\n[backends.cpu]\nkernels = "numba"\nthreads = 1\n')
    (cpu,) = make_backends(load_config(path=path, env={}), registry)
    assert (cpu.kernel_mode, cpu.threads) == ("numba", 1)
    path.write_text('backend = "cpu"\n[backends.cpu]\nthread = 1\n')
    with pytest.raises(ConfigError, match=r"unknown option.*thread; the cpu backend takes"):
        make_backends(load_config(path=path, env={}), registry)
