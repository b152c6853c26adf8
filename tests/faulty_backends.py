"""Backends that break the contract on purpose, for the tests of the tools that must catch them.

Each is the cpu oracle with one kernel replaced. ``PLUGIN_SOURCE`` is the same sloppy backend as
an installable plugin module (see the ``sloppy_plugin`` fixture in conftest.py).
"""

from __future__ import annotations

import itertools
from types import MappingProxyType

import numpy as np

from parity.backends.cpu.backend import KERNELS, CpuBackend
from parity.core.ir import Op


def swiglu_via_np_exp(g, u, arg):
    """silu through np.exp: the kind of 'optimisation' the contract forbids."""
    return (g / (np.float32(1) + np.exp(-g)) * u).astype(np.float32)


class SloppyBackend(CpuBackend):
    """swiglu via np.exp, while claiming every op exact."""

    name = "sloppy"
    kernels = MappingProxyType({**KERNELS, Op.SWIGLU: swiglu_via_np_exp})


class HonestSloppyBackend(SloppyBackend):
    """The same kernels, with swiglu declared as a bound it keeps."""

    name = "honest-sloppy"
    manifest = MappingProxyType({"*": "exact", "SWIGLU": "ulp<=8"})


def kv_write_one_row_late(cache, rows, pos, arg):
    cache[pos + 1] = rows
    return cache


def add_in_place(a, b, arg):
    np.add(a, b, out=a)
    return a


def mul_past_the_end(a, b, arg):
    """Writes one element past the end of its input's allocation, as a kernel with a wrong
    bound would."""
    out = np.multiply(a, b)
    base = a
    while base.base is not None:
        base = base.base
    offset = (a.ctypes.data - base.ctypes.data) // a.itemsize
    base.reshape(-1)[offset + a.size] = 1.0
    return out


_calls = itertools.count()


def add_noisy(a, b, arg):
    out = np.add(a, b)
    out.reshape(-1)[0] += np.float32(next(_calls) % 2)  # every other call differs
    return out


def crash(x, arg):
    raise RuntimeError("kernel launch failed")


def faulty(op: Op, fn) -> type[CpuBackend]:
    """A cpu backend named ``faulty`` whose ``op`` runs ``fn``."""
    kernels = MappingProxyType({**KERNELS, op: fn})
    return type("Faulty", (CpuBackend,), {"name": "faulty", "kernels": kernels})


class PartialBackend(CpuBackend):
    name = "partial"

    def supports_op(self, node, srcs):
        return node.op is not Op.ROPE


PLUGIN_SOURCE = """
from parity.core.hookspecs import hookimpl


@hookimpl
def parity_register_backends(register):
    from faulty_backends import SloppyBackend

    register(SloppyBackend)
"""


HEAD_ROWS = 384  # the vocabulary of the model the next backend is tested on


def _matmul_wrong_head(x, w, b=None, arg=None):
    out = KERNELS[Op.MATMUL](x, w, b, arg=arg)
    return out * np.float32(1.5) if out.shape[1] == HEAD_ROWS else out


class BoundedButWrongHead(HonestSloppyBackend):
    """A bounded swiglu (as declared) and a real bug in the output projection, which sits far
    downstream of the first bounded difference."""

    name = "wrong-head"
    kernels = MappingProxyType({**HonestSloppyBackend.kernels, Op.MATMUL: _matmul_wrong_head})


class TwoModeBackend(CpuBackend):
    """The oracle's kernels in exact numerics; under fast, swiglu via np.exp, declared in a
    fast_manifest: a backend whose fast kernels differ from its exact ones."""

    name = "two-mode"
    numerics_modes = ("exact", "fast")
    fast_manifest = MappingProxyType({"*": "exact", "SWIGLU": "ulp<=8"})

    def __init__(self, *args, **kwargs) -> None:
        if kwargs.get("numerics") == "fast":
            self.kernels = MappingProxyType({**KERNELS, Op.SWIGLU: swiglu_via_np_exp})
        super().__init__(*args, **kwargs)
