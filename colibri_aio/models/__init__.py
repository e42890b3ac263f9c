"""Shipped models (GGUF files installed with the package)."""
