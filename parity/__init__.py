"""parity: an LLM inference runtime whose every backend answers to one bit-exact CPU oracle.

``parity.load(model)`` opens a model (a registry name, pulled on first use, or a path to a
``.gguf`` file) on the configured backend; see ``parity.model.Model``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["__version__", "load"]

if TYPE_CHECKING:
    from parity.model import load


def __getattr__(name: str) -> Any:
    # imported on first use, so `import parity` stays light (no tokenizer, jinja2 or numba)
    if name == "load":
        from parity.model import load

        return load
    raise AttributeError(f"module 'parity' has no attribute {name!r}")
