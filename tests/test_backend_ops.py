"""Every op on every backend, bit for bit against the cpu oracle.

Each case is a one-op graph with seeded inputs (shape first, then dtype, then values, special
values included). ``--backend NAME`` selects the backend under test; backends that cannot run
here (no GPU) skip. On the cpu backend this checks the harness itself and determinism.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import numpy as np
import pytest

from parity.backends.cpu.backend import CpuBackend
from parity.core.backend import Device
from parity.core.builder import GraphBuilder
from parity.core.dtypes import WEIGHT_TYPES, DType
from parity.core.ir import AttentionArg, Graph, Op, RopeArg, SliceArg
from parity.core.runtime import Runtime
from parity.core.weights import WeightData
from parity.models.decoder import rope_tables
from parity.quant.synthetic import random_weight

F32, I32 = DType.F32, DType.I32
SPECIAL = np.array([0.0, -0.0, 1e-45, -1e-40, 1.17549435e-38, 1e30, -1e30, 1.0, -1.0, 0.5],
                   np.float32)  # fmt: skip


@attrs.frozen
class OpCase:
    id: str
    graph: Graph
    inputs: dict = attrs.field(eq=False)
    weights: dict = attrs.field(eq=False)


def activations(rng, shape, special=True, scale=1.0):
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    if special:
        flat = x.reshape(-1)
        flat[: SPECIAL.size] = SPECIAL[: flat.size]
        x[-1] = x[-1, 0]  # an all-equal row
    return x


def case(name: str, build: Callable[[GraphBuilder, dict, dict], object], seed: int = 0):
    rng = np.random.default_rng(seed)
    b, inputs, weights = GraphBuilder(), {}, {}

    def inp(key, value, dtype=F32):
        inputs[key] = value
        return b.input(key, dtype, value.shape)

    def weight(key, dtype, shape, data=None):
        data = random_weight(dtype, shape, rng, edge=True) if data is None else data
        weights[key] = WeightData(key, dtype, shape, data)
        return b.weight(key, dtype, shape)

    out = build(b, rng, inp, weight)
    return OpCase(name, b.build(out), inputs, weights)


def cases() -> list[OpCase]:
    out = []
    for dtype in WEIGHT_TYPES:
        k = 256
        out.append(
            case(
                f"get_rows-{dtype.name}",
                lambda b, rng, inp, w, d=dtype, k=k: b.op(
                    Op.GET_ROWS,
                    w("emb", d, (40, k)),
                    inp("ids", np.array([0, 39, 7, 7], np.int32), I32),
                ),
            )
        )
        for t, kk in ((1, 256), (5, 512)):
            out.append(case(f"matmul-{dtype.name}-t{t}-k{kk}",
                            lambda b, rng, inp, w, d=dtype, t=t, kk=kk: b.op(
                                Op.MATMUL, inp("x", activations(rng, (t, kk))),
                                w("w", d, (48, kk)))))  # fmt: skip
    out.append(
        case(
            "matmul-bias",
            lambda b, rng, inp, w: b.op(
                Op.MATMUL,
                inp("x", activations(rng, (3, 896))),
                w("w", DType.Q5_0, (64, 896)),
                w("bias", F32, (64,)),
            ),
        )
    )
    out.append(
        case(
            "slice_rows",
            lambda b, rng, inp, w: b.op(
                Op.SLICE_ROWS, inp("x", activations(rng, (6, 64))), arg=SliceArg(2, 3)
            ),
        )
    )
    for op in (Op.ADD, Op.MUL, Op.SWIGLU):
        out.append(
            case(
                op.name.lower(),
                lambda b, rng, inp, w, op=op: b.op(
                    op,
                    inp("a", activations(rng, (4, 576))),
                    inp("b", activations(rng, (4, 576), scale=3)),
                ),
            )
        )
    for op in (Op.ADD, Op.MUL):
        out.append(
            case(
                f"{op.name.lower()}-row",
                lambda b, rng, inp, w, op=op: b.op(
                    op, inp("a", activations(rng, (4, 576))), w("v", F32, (576,))
                ),
            )
        )
    out.append(
        case(
            "silu",
            lambda b, rng, inp, w: b.op(Op.SILU, inp("x", activations(rng, (3, 896), scale=30))),
        )
    )
    for width in (576, 896):
        out.append(
            case(
                f"rms_norm-{width}",
                lambda b, rng, inp, w, width=width: b.op(
                    Op.RMS_NORM, inp("x", activations(rng, (5, width))), arg=float(np.float32(1e-5))
                ),
            )
        )
    for mode, n_rot in (("normal", 64), ("neox", 64), ("neox", 32)):

        def rope(b, rng, inp, w, mode=mode, n_rot=n_rot):
            cos, sin = rope_tables(512, n_rot, 10000.0)
            return b.op(Op.ROPE, inp("x", activations(rng, (4, 9 * 64))),
                        inp("pos", np.array([0, 1, 300, 511], np.int32), I32),
                        w("cos", F32, cos.shape, cos), w("sin", F32, sin.shape, sin),
                        arg=RopeArg(9, 64, n_rot, mode))  # fmt: skip

        out.append(case(f"rope-{mode}-{n_rot}", rope))
    for heads, kv, t in ((9, 3, 300), (14, 2, 3)):

        def attention(b, rng, inp, w, heads=heads, kv=kv, t=t):
            pos = inp("pos", np.arange(t, dtype=np.int32), I32)
            k = inp("k", activations(rng, (t, kv * 64), special=False))
            v = inp("v", activations(rng, (t, kv * 64)))
            kc = b.op(Op.KV_WRITE, b.state("k", (320, kv * 64)), k, pos)
            vc = b.op(Op.KV_WRITE, b.state("v", (320, kv * 64)), v, pos)
            q = inp("q", activations(rng, (t, heads * 64), special=False))
            return b.op(Op.ATTENTION, q, kc, vc, pos, arg=AttentionArg(heads, kv, 64, 0.125))

        out.append(case(f"attention-{heads}x{kv}-t{t}", attention))

    def argmax(b, rng, inp, w):
        x = activations(rng, (4, 1000), special=False)
        x[1, [10, 20]] = 1e9  # a tie: the first index wins
        x[2, 30] = np.nan
        return b.op(Op.ARGMAX, inp("x", x))

    out.append(case("argmax", argmax))
    return out


CASES = cases()


def test_every_op_is_covered():
    covered = {n.op for c in CASES for n in c.graph if not n.op.is_leaf}
    assert covered == {op for op in Op if not op.is_leaf}


@pytest.mark.parametrize("opcase", CASES, ids=[c.id for c in CASES])
def test_op_matches_oracle_bitwise(backend_cls, opcase):
    oracle = Runtime([CpuBackend(Device("cpu"))], opcase.weights)
    device = backend_cls.devices()[0]
    candidate = Runtime([backend_cls(device)], opcase.weights, strict=True)
    want = oracle.run(opcase.graph, opcase.inputs)
    got = candidate.run(opcase.graph, opcase.inputs)
    for i in opcase.graph.outputs:
        assert got[i].dtype == want[i].dtype and got[i].shape == want[i].shape
        assert got[i].tobytes() == want[i].tobytes(), f"%{i} differs from the cpu oracle"


@pytest.mark.parametrize("opcase", CASES, ids=[c.id for c in CASES])
def test_cpu_numba_kernels_match_the_numpy_definition(opcase):
    """The cpu backend's two implementations of every op give the same bits."""
    runs = [
        Runtime([CpuBackend(Device("cpu"), kernels=kernels)], opcase.weights).run(
            opcase.graph, opcase.inputs
        )
        for kernels in ("numpy", "numba")
    ]
    for i in opcase.graph.outputs:
        assert runs[1][i].tobytes() == runs[0][i].tobytes(), f"%{i} differs"
