"""Decode attention kernels of the cuda backend timed alone on the GPU, for A/B runs of kernel
sources: each ``attention.cu`` given (default: the backend's own) runs ``attention_chunks<64>``
at the heads of SmolLM2 (9/3) and Qwen2.5 (14/2) and several positions, ``--launches`` launches
in one CUDA graph, timed with CUDA events, median of ``--runs`` replays; then the same with a
quantized GEMV between the launches (what a decode step does), and each kernel with the
preferred shared-memory carveout pinned (``--carveout``), to show a kernel's cost that comes
from the SM switching its L1/shared split. Prints one line per case (µs a launch).

    python benchmarks/bench_cuda_kernels.py [SOURCE.cu ...] [--positions 50,200,600,1000]
"""

from __future__ import annotations

import argparse
import ctypes
import math
import statistics
from pathlib import Path

import torch

from parity.backends.cuda import discovery
from parity.backends.cuda.kernel_args import AttnArg, Q8Arg
from parity.backends.cuda.library import KERNELS, sources
from parity.backends.cuda.nvrtc import Compiler
from parity.backends.gpu.driver import Driver, Launch, pack, pointer

CARVEOUT = 9  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT


def build(compiler: Compiler, driver: Driver, path: Path, names: list[str]) -> dict[str, int]:
    _, headers = sources()
    module = compiler.compile(path.stem, path.read_text(), names, headers)
    handle = driver.load(module.cubin)
    return {n: driver.function(handle, module.names[n]) for n in names}


def timed(stream, launches: list[Launch], driver: Driver, runs: int) -> float:
    """µs a launch: the launches as one CUDA graph, median of ``runs`` replays."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin()
        for launch in launches:
            driver.launch(launch, stream.cuda_stream)
        graph.capture_end()
        for _ in range(3):
            graph.replay()
        times = []
        for _ in range(runs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            graph.replay()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / len(launches))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("sources", nargs="*", type=Path, default=[KERNELS / "attention.cu"])
    ap.add_argument("--positions", default="50,200,600,1000")
    ap.add_argument("--launches", type=int, default=60)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--carveout", type=int, default=100, help="percent, for the pinned rows")
    args = ap.parse_args()
    gpu = discovery.probe().usable[0]
    driver = Driver(gpu.index)
    compiler = Compiler(gpu.arch)
    torch.cuda.init()
    stream = torch.cuda.Stream()
    dev = torch.device("cuda", gpu.index)
    n_ctx, d = 1024, 64
    gemv_name = "gemv_q<3, 1, 0, 1>"
    gemv = build(compiler, driver, KERNELS / "matmul.cu", [gemv_name])[gemv_name]
    k_in, n_out = 576, 576  # SmolLM2's o projection, Q4_1
    row_bytes = k_in // 32 * 20
    w = torch.randint(0, 256, (n_out * row_bytes + 16,), dtype=torch.uint8, device=dev)
    w[1::20] &= 0x3B  # finite fp16 scales and mins
    w[3::20] &= 0x3B
    xq = torch.randint(-127, 128, (1, k_in), dtype=torch.int8, device=dev)
    xd = torch.rand(1, k_in // 32, device=dev)
    xs = torch.rand(1, k_in // 32, device=dev)
    y = torch.empty(1, n_out, device=dev)
    q8 = Q8Arg(xq.data_ptr(), xd.data_ptr(), xs.data_ptr())
    gemv_args = pack([pointer(y), q8, pointer(w), pointer(None), pointer(None), pointer(None),
                      1, n_out, k_in, ctypes.c_longlong(row_bytes)])  # fmt: skip
    gemv_launch = Launch("gemv", gemv, (-(-n_out // 4), 1, 1), (128, 1, 1), 0, gemv_args)
    for path in args.sources:
        fn = build(compiler, driver, path, ["attention_chunks<64>"])["attention_chunks<64>"]
        for n_head, n_kv in ((9, 3), (14, 2)):
            q = torch.randn(1, n_head * d, device=dev)
            k = torch.randn(n_ctx, n_kv * d, device=dev)
            v = torch.randn(n_ctx, n_kv * d, device=dev)
            out = torch.empty(1, n_head * d, device=dev)
            chunks = n_ctx // 256
            part = torch.zeros(n_head * chunks * (d + 1), device=dev)
            tickets = torch.zeros(n_head, dtype=torch.int32, device=dev)
            for p in (int(x) for x in args.positions.split(",")):
                pos = torch.tensor([p], dtype=torch.int32, device=dev)
                a = AttnArg()
                a.q, a.k, a.v, a.positions, a.out = (t.data_ptr() for t in (q, k, v, pos, out))
                a.part, a.tickets = part.data_ptr(), tickets.data_ptr()
                a.n_head, a.n_head_kv, a.n_ctx = n_head, n_kv, n_ctx
                a.chunks_one_launch, a.scale = chunks, 1 / math.sqrt(d)  # (one launch)
                attn = Launch("attn", fn, (n_head, 1, chunks), (256, 1, 1), 0, (a,))
                row = {}
                row["alone"] = timed(stream, [attn] * args.launches, driver, args.runs)
                pair = timed(stream, [gemv_launch, attn] * args.launches, driver, args.runs) * 2
                gemv_alone = timed(stream, [gemv_launch] * args.launches, driver, args.runs)
                row["with gemv"] = pair - gemv_alone
                row["gemv alone"] = gemv_alone
                for f in (fn, gemv):
                    driver.check(driver.lib.cuFuncSetAttribute(f, CARVEOUT, args.carveout), "carve")
                pair = timed(stream, [gemv_launch, attn] * args.launches, driver, args.runs) * 2
                row[f"with gemv, carveout {args.carveout}"] = pair - gemv_alone
                for f in (fn, gemv):
                    driver.check(driver.lib.cuFuncSetAttribute(f, CARVEOUT, -1), "carve")
                cells = "  ".join(f"{k} {v:6.2f}" for k, v in row.items())
                print(f"{path.name:18s} heads {n_head:2d}/{n_kv} p {p:4d}: {cells}", flush=True)


if __name__ == "__main__":
    main()
