"""The argument structs of the cuda backend's kernels, laid out as the ``.cu`` sources declare
them (a kernel takes one by value; ``pack`` passes it through)."""

from __future__ import annotations

import ctypes


class Q8Arg(ctypes.Structure):
    """``struct Q8`` of matmul.cu."""

    _fields_ = [("q", ctypes.c_void_p), ("d", ctypes.c_void_p), ("s", ctypes.c_void_p)]


class AttnArg(ctypes.Structure):
    """``struct AttnArgs`` of attention.cu."""

    _fields_ = (
        [
            (name, ctypes.c_void_p)
            for name in (
                "q",
                "k",
                "v",
                "positions",
                "out",
                "oq",
                "od",
                "os",
                "part",
                "pmax",
                "scores",
                "tickets",
            )
        ]
        + [
            (name, ctypes.c_int)
            for name in (
                "n_head",
                "n_head_kv",
                "n_ctx",
                "chunks_one_launch",
                "window",
                "n_tokens",
                "tile_tokens",
            )
        ]
        + [("scale", ctypes.c_float)]
    )


class RopeArg(ctypes.Structure):
    """``struct RopeArgs`` of rows.cu (a second rope or the v rows: null / 0 when absent)."""

    _fields_ = [
        (name, ctypes.c_void_p)
        for name in ("y0", "x0", "cache0", "y1", "x1", "cache1", "v", "v_cache", "positions",
                     "cos_t", "sin_t")
    ] + [
        (name, ctypes.c_int)
        for name in ("heads0", "heads1", "v_width", "n_tokens", "head_dim", "n_rot")
    ]  # fmt: skip


class GemvSegArg(ctypes.Structure):
    """``struct GemvSeg`` of matmul.cu."""

    _fields_ = [
        ("y", ctypes.c_void_p),
        ("w", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("row_bytes", ctypes.c_longlong),
        ("N", ctypes.c_int),
        ("blocks", ctypes.c_int),
    ]


class GemvSegsArg(ctypes.Structure):
    """``struct GemvSegs`` of matmul.cu: up to three products in one launch (unused: N = 0),
    of gemv_q_multi or gemm_mma_multi."""

    _fields_ = [("s0", GemvSegArg), ("s1", GemvSegArg), ("s2", GemvSegArg)]


class RopeSegsArg(ctypes.Structure):
    """``struct RopeSegs`` of matmul.cu: the ROPEs and KV_WRITEs a q/k/v launch does too (and
    with HEAD_NORM the head norms before them)."""

    _fields_ = [
        ("out", ctypes.c_void_p * 2),
        ("cache", ctypes.c_void_p * 3),
        ("positions", ctypes.c_void_p),
        ("cos_t", ctypes.c_void_p),
        ("sin_t", ctypes.c_void_p),
        ("normed", ctypes.c_void_p * 2),
        ("norm_w", ctypes.c_void_p * 2),
        ("tickets", ctypes.c_void_p),
        ("eps", ctypes.c_float * 2),
        ("heads0", ctypes.c_int),
        ("head_dim", ctypes.c_int),
        ("n_rot", ctypes.c_int),
    ]


class MmaMoreArg(ctypes.Structure):
    """``struct MmaMore`` of matmul.cu: what a gemm_mma launch writes besides y (null: not),
    and the flagged tokens whose tiles alone it computes (null: every tile)."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("gate", "up", "q", "d", "s", "flagged")]


class NormJobArg(ctypes.Structure):
    """``struct NormJob`` of rows.cu: a norm of a norm launch (rms_norm_f32, rms_norm_slots,
    rms_norm_warps), with the ADD and the norm of the sum that may follow it (null: not
    done)."""

    _fields_ = [
        (name, ctypes.c_void_p)
        for name in ("y", "q", "qd", "qs", "sum", "x", "w", "res", "y2", "q2", "qd2", "qs2", "w2")
    ] + [("eps", ctypes.c_float), ("eps2", ctypes.c_float), ("rows", ctypes.c_int)]


class NormRowsArg(ctypes.Structure):
    """``struct NormRows`` of rows.cu: up to two norm jobs of one width in one launch."""

    _fields_ = [("a", NormJobArg), ("b", NormJobArg), ("width", ctypes.c_int)]


class NormInArg(ctypes.Structure):
    """``struct NormIn`` of norm.cuh: a decode norm made by the products that read it, from the
    output of the residual product before it and that product's subtrees of the squares."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("x", "parts", "w", "y", "q", "qd", "qs")] + [
        ("eps", ctypes.c_float),
        ("np", ctypes.c_int),
        ("level", ctypes.c_int),
    ]
