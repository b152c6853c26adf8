"""The cpu backend's compiled kernels (numba): the same operations as ``ops.py``, in the same
order, without numpy's per-call overhead and without the float32 weight planes.

Imported only when a CpuBackend runs with ``kernels="numba"`` (importing numba takes a while).
``compile`` says how every kernel is compiled and cached; ``simd`` holds the LLVM vector code
(exact integer block sums, fixed trees, 16 lanes of terms); ``blocks`` reads one weight row in
the contract's sub-block form; ``activation``, ``matmul``, ``elementwise``, ``attention`` and
``reduce`` mirror the numpy definition; ``ops`` checks arguments and calls them.
"""
