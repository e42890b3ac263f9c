"""Forward passes, one module per model family, on the shared kernels and expert sources."""
