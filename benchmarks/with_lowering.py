"""Run a script or module with switches of the cuda lowering set: for checks and A/B runs of
kernels that are off by default until a GPU has timed them (docs/perf.md).

    python benchmarks/with_lowering.py PREFILL_TILES=1 NORM_AFTER_PRODUCT=1 -- \\
        benchmarks/bench_gpu_steps.py MODEL.gguf --profile
    python benchmarks/with_lowering.py NORM_AFTER_PRODUCT=1 -- -m parity conformance cuda

Each NAME=VALUE sets ``parity.backends.cuda.lowering.NAME`` (VALUE a Python literal) before
the script runs, in this process, and NAME[KEY]=VALUE one entry of a dict there
(``CHUNKS_ONE_LAUNCH[256]=2``); a name the lowering does not have is an error.
"""

from __future__ import annotations

import ast
import runpy
import sys
from collections.abc import Callable


def set_switch(setting: str) -> Callable[[], None]:
    """Set ``NAME=VALUE`` or ``NAME[KEY]=VALUE`` in the cuda lowering; returns what puts the
    old value back. SystemExit for a setting that is not one of a lowering switch."""
    from parity.backends.cuda import lowering

    name, eq, value = setting.partition("=")
    name, _, key = name.partition("[")  # NAME[KEY]=VALUE: one entry of a dict switch
    if not eq or not hasattr(lowering, name) or (key and not key.endswith("]")):
        sys.exit(f"{setting!r} is not NAME=VALUE or NAME[KEY]=VALUE of a lowering switch")
    old = getattr(lowering, name)
    if key:
        setattr(lowering, name, {**old, ast.literal_eval(key[:-1]): ast.literal_eval(value)})
    else:
        setattr(lowering, name, ast.literal_eval(value))
    print(f"lowering.{name} = {getattr(lowering, name)!r}", file=sys.stderr)
    return lambda: setattr(lowering, name, old)


def main(argv: list[str]) -> None:
    if "--" not in argv:
        sys.exit("usage: with_lowering.py NAME=VALUE ... -- SCRIPT.py ARGS | -m MODULE ARGS")
    cut = argv.index("--")
    settings, command = argv[:cut], argv[cut + 1 :]
    if not command:
        sys.exit("with_lowering.py: no script or module to run after --")
    for setting in settings:
        set_switch(setting)
    if command[0] == "-m":
        sys.argv = command[1:]
        runpy.run_module(command[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = command
        runpy.run_path(command[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
