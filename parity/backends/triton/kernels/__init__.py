"""The triton backend's kernels, one module per op family."""
