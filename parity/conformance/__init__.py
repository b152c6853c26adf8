"""The conformance kit: the numeric contract's op suite, runnable against any backend.

``parity conformance NAME`` prints a table (op x type: exact, within the declared bound, or
FAIL); ``pytest --parity-backend NAME`` runs the same suite as tests in any repository (the
``pytest11`` plugin ``parity.conformance.pytest_plugin``). Both also replay case files that
``parity compare`` saved.
"""
