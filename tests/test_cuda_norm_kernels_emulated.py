"""The cuda backend's decode norm a slot a thread (rows.cu's ``rms_norm_slots``), run on the CPU
through the emulator in ``tests/cuda_emulator``, bit for bit against the oracle's RMS_NORM, MUL,
ADD and activation quantization: every width its lowering gives it (a multiple of 32 up to
1,024, powers of two and not), rows whose squares overflow, two jobs in one launch, the ADD's
sum and the norm of that sum (Gemma 3's chained norms), each with its quantization; the loads
it may issue before PDL's wait, against the emulator's late writes."""

from __future__ import annotations

import numpy as np
import pytest
from cuda_emulator import compile_kernels, compiler

from parity.backends.cpu import ops
from parity.backends.cuda.kernel_args import NormJobArg, NormRowsArg
from parity.backends.cuda.lowering import NORM_EARLY_RES, NORM_EARLY_W
from parity.conformance.suite import SPECIAL

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C++ compiler for the emulator")

F32 = np.float32
EPS = F32(1e-6)
MODES = (0, NORM_EARLY_W, NORM_EARLY_RES, NORM_EARLY_W | NORM_EARLY_RES)


@pytest.fixture(scope="module", params=["forward", "reverse"])
def lib(request):
    """The kernels, a block's threads resumed first to last between barriers, or last to first:
    a missing barrier between a write and a read shows in one order or the other."""
    lib = compile_kernels("rows.cu", [f"rms_norm_slots<{m}>" for m in MODES])
    lib.reverse = request.param == "reverse"
    return lib


def rows(rng, t: int, width: int, scale: float = 1.0) -> np.ndarray:
    """Seeded rows, the first with the kit's special values planted (its ±1e30 overflow the
    squares' sum: the row norms to signed zeros), the last constant where there are three."""
    x = (rng.standard_normal((t, width)) * scale).astype(F32)
    x[0, : SPECIAL.size] = SPECIAL
    if t > 2:
        x[-1] = x[-1, 0]
    return x


class Job:
    """One norm job's host arrays and its NormJobArg: y = x normed (and weighted), quantized;
    with ``res``, sum = res + y, and with ``chained``, y2 = norm(sum) weighted by w2, quantized."""

    def __init__(self, rng, t: int, width: int, weighted: bool, res: bool, chained: bool):
        self.x = rows(rng, t, width)
        self.w = rng.standard_normal(width).astype(F32) if weighted else None
        self.res = rows(rng, t, width, scale=3.0) if res else None
        self.w2 = rng.standard_normal(width).astype(F32) if chained else None
        self.out = outputs(t, width, "")
        if res:
            self.out["sum"] = np.full((t, width), np.nan, F32)
        if chained:
            self.out |= outputs(t, width, "2")
        self.arg = NormJobArg()
        for name, a in [*self.out.items(), ("x", self.x), ("w", self.w), ("res", self.res),
                        ("w2", self.w2)]:  # fmt: skip
            setattr(self.arg, name, None if a is None else a.ctypes.data)
        self.arg.eps, self.arg.eps2, self.arg.rows = EPS, EPS, t

    def expected(self) -> dict[str, np.ndarray]:
        """The oracle's values of what the job writes."""
        y = ops.rms_norm(self.x, EPS) if self.w is None else ops.rms_norm_mul(self.x, self.w, EPS)
        want = {"y": y, **quantized(y, "")}
        if self.res is not None:
            want["sum"] = ops.add(self.res, y)
        if self.w2 is not None:
            y2 = ops.rms_norm_mul(want["sum"], self.w2, EPS)
            want |= {"y2": y2, **quantized(y2, "2")}
        return want


def outputs(t: int, width: int, suffix: str) -> dict[str, np.ndarray]:
    """A norm's outputs before the launch: y, and its quants with each block's d and s."""
    blocks = (t, width // 32)
    return {f"y{suffix}": np.full((t, width), np.nan, F32),
            f"q{suffix}": np.zeros((t, width), np.int8),
            f"qd{suffix}": np.full(blocks, np.nan, F32),
            f"qs{suffix}": np.full(blocks, np.nan, F32)}  # fmt: skip


def quantized(y: np.ndarray, suffix: str) -> dict[str, np.ndarray]:
    q = ops.quantize(y)
    return {f"q{suffix}": q.q, f"qd{suffix}": q.d, f"qs{suffix}": q.s}


def launch(lib, jobs: list[Job], width: int, mode: int = 0, late=()) -> None:
    """One rms_norm_slots<mode> launch of one or two jobs, as the lowering gives it: a block a
    row, the row's width of threads. ``late``: (dst, truth) arrays, late writes (NaN at each
    block's start, the truth once its threads pass the wait)."""
    a = NormRowsArg()
    a.width = width
    a.a = jobs[0].arg
    if len(jobs) > 1:
        a.b = jobs[1].arg
    poisons = []
    for dst, truth in late:
        poisons.append(np.full_like(dst, np.nan))
        lib.late_write(dst.ctypes.data, poisons[-1].ctypes.data, truth.ctypes.data, dst.nbytes)
    lib.launch(f"rms_norm_slots<{mode}>", (sum(j.arg.rows for j in jobs),), (width,), [a])


def assert_bits(job: Job) -> None:
    for name, want in job.expected().items():
        got = job.out[name]
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), name


@pytest.mark.parametrize("width", [32, 64, 96, 320, 576, 640, 896, 1024])
def test_a_norm_of_any_width_is_bit_exact(lib, width) -> None:
    """Rows of 32 (one warp, no subtrees to share) to 1,024, 96 and 320 with padding subtrees
    past the row, weighted and quantized; three rows: the specials' overflow, a random one, a
    constant one."""
    rng = np.random.default_rng(width)
    job = Job(rng, 3, width, weighted=True, res=False, chained=False)
    launch(lib, [job], width)
    assert_bits(job)


@pytest.mark.parametrize("width", [64, 640])
def test_two_jobs_sums_and_chained_norms_are_bit_exact(lib, width) -> None:
    """Job a: two rows normed without a weight, added to a residual, the sum normed again with
    its own weight (Gemma 3's norm after attention, the ADD, the norm before the FFN), both
    quantized; job b: a weighted row of its own (Gemma 3's k head norm after q's), in the
    blocks after a's."""
    rng = np.random.default_rng(width + 1)
    a = Job(rng, 2, width, weighted=False, res=True, chained=True)
    b = Job(rng, 1, width, weighted=True, res=False, chained=False)
    launch(lib, [a, b], width)
    assert_bits(a)
    assert_bits(b)


@pytest.mark.parametrize("mode", MODES)
def test_x_written_late_is_read_after_the_wait(lib, mode) -> None:
    """x is the kernel before's output: under PDL it lands after the kernel starts. Every
    mode loads it after its wait, so a late write of x (NaN until the wait) changes nothing."""
    rng = np.random.default_rng(7)
    job = Job(rng, 2, 576, weighted=True, res=True, chained=True)
    truth = job.x.copy()
    launch(lib, [job], 576, mode, late=[(job.x, truth)])
    assert_bits(job)


@pytest.mark.parametrize("mode", MODES)
def test_the_residual_is_loaded_before_the_wait_only_in_its_mode(lib, mode) -> None:
    """The residual is loaded before the wait in NORM_EARLY_RES's modes only (the lowering
    gives them a residual the kernel before cannot be writing): a late write of it (a stand-in
    the lowering never makes for those modes) shows in the sums there, and nowhere else."""
    rng = np.random.default_rng(8)
    job = Job(rng, 2, 640, weighted=True, res=True, chained=False)
    truth = job.res.copy()
    launch(lib, [job], 640, mode, late=[(job.res, truth)])
    if mode & NORM_EARLY_RES:
        assert np.isnan(job.out["sum"]).all()
    else:
        assert_bits(job)
