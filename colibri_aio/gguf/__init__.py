"""Reading GGUF files: the header (metadata and tensor table) and the model's trunk and expert ranges."""
