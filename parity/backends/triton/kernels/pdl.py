"""Programmatic dependent launch (PDL, sm_90 and newer): a kernel launched with it may start
while the kernel before it on the stream still runs, so its launch and whatever it reads that
no kernel writes (a product's weights) overlap the previous kernel's work instead of following
it. Every kernel the backend launches that way calls ``after_previous`` before it reads or
writes anything another kernel touches: ``griddepcontrol.wait`` returns once the previous grid
has finished and its writes are visible, and ``launch_dependents`` then lets the next kernel
start. The bits do not depend on it: only when the work starts does.

``PDL`` is a compile-time switch: off, the call is nothing (Triton's interpreter, GPUs before
sm_90, or ``PARITY_PDL=0``).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def after_previous(PDL: tl.constexpr):
    """Wait for the previous kernel on the stream (its writes visible), then let the next one
    start (it waits for this one in turn)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
