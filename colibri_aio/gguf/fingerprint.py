"""A model's identity for the files kept about it: its GGUF header and file size, never its path.

A model moved or copied keeps its usage history and its cached tokenizer; a
different model at the same path never picks up either.
"""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from colibri_aio.gguf.model import Model


def model_fingerprint(model: Model) -> str:
    """A hex digest of the GGUF's header (metadata and tensor table) and file size (never its path); of a
    split model, of every part's, in order (a model in one file keeps the digest it always had)."""
    h = hashlib.sha256()
    for part, (identity, header) in enumerate(zip(model.identities, model.reader.parts)):
        if part:
            h.update(f"part={part}\n".encode())
        h.update(f"size={identity.size}\n".encode())
        h.update(header.header_bytes)
    return h.hexdigest()[:32]
