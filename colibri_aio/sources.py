"""Choosing where routed experts' bytes come from (``--io``)."""
from __future__ import annotations

from colibri_aio.errors import UserError
from colibri_aio.experts import ExpertSource
from colibri_aio.gguf_model import Model
from colibri_aio.mapped_source import MappedExpertSource

IO_CHOICES = ("auto", "mmap")


async def open_source(model: Model, io: str = "auto") -> ExpertSource:
    """An expert source for ``model`` with the requested I/O backend."""
    if io in ("auto", "mmap"):
        return MappedExpertSource(model)
    raise UserError(f"unknown --io backend {io!r} (choose from {', '.join(IO_CHOICES)})")
