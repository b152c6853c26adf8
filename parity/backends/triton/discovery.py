"""Whether the triton backend can run here, without importing triton or torch.

Two ways to run: on NVIDIA GPUs (the driver's answer, ``parity.backends.cuda.discovery``), or,
when ``TRITON_INTERPRET=1`` is set, through Triton's interpreter on the CPU (one device,
``triton:0``, which ``auto`` never picks: it is for checking kernels, not for speed). The
switch is read once per process, as Triton itself reads it when it is imported.
"""

from __future__ import annotations

import functools
import importlib.util
import os

INTERPRET_ENV = "TRITON_INTERPRET"


@functools.cache
def interpreting() -> bool:
    return os.environ.get(INTERPRET_ENV, "").strip().lower() in ("1", "true", "on", "yes")


def missing_packages() -> str:
    """Why the Python side cannot run (triton or torch absent, or no CUDA torch for a GPU)."""
    for name in ("triton", "torch"):
        if importlib.util.find_spec(name) is None:
            return f"{name} is not installed; pip install 'parity[triton]'"
    if interpreting():
        return ""
    from parity.backends.cuda.discovery import missing_packages as cuda_missing

    reason = cuda_missing()
    if reason.startswith("the installed torch is a CPU-only build"):
        return (
            "the installed torch is a CPU-only build; install a CUDA build of torch, or set "
            f"{INTERPRET_ENV}=1 to run the kernels in Triton's interpreter"
        )
    return ""
