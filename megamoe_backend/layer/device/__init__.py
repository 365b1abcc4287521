"""The sync-free, CUDA-graph-capturable forward (ep_size 1): status word, route and top-k sum
kernels, and the workspace they share. Imported only where Triton runs (CUDA, or the interpreter)."""
