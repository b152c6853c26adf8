"""The ``parity`` command. stdout carries only the product (generated text, ids, JSON);
progress and diagnostics go to stderr."""

from parity.cli.main import main

__all__ = ["main"]
