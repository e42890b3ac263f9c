"""Text in and out: the tokenizer and chat template from GGUF metadata, and the samplers."""
