"""The GPU runtime shared by parity's GPU backends (cuda, triton): memory, one stream, pinned
host buffers and CUDA graphs, on PyTorch. Nothing here imports torch at module import."""
