"""Kernel backends on views of raw GGUF bytes: ggml's CPU kernels and the NumPy reference (:mod:`.backend`)."""
