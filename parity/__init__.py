"""parity: an LLM inference runtime whose every backend answers to one bit-exact CPU oracle."""

__version__ = "0.1.0"
