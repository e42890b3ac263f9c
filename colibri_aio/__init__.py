"""colibri-aio: run MoE models larger than RAM, straight from GGUF files."""
__version__ = "0.1.0"
