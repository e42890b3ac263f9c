"""Building blocks of tools/make_synthetic_gguf.py: shapes, block encoders, routers, tokenizer, writer."""
