"""Pure NumPy kernels on views of raw GGUF bytes."""
