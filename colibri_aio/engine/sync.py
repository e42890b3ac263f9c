"""A plain iterator over generation, for scripts that do not run an event loop."""
from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from typing import Any

from colibri_aio.engine.engine import Engine, GenerationPiece, Prompt


def generate(prompt: Prompt, model: str | os.PathLike[str] | None = None, *, max_tokens: int = 128,
             placement: dict[str, Any] | None = None, **sampling: Any) -> Iterator[GenerationPiece]:
    """Stream a continuation of ``prompt`` (text or chat messages) piece by piece.

    ``model``: a GGUF path (default: the shipped model). ``placement``: keyword
    arguments of :meth:`Engine.open` (``io``, ``ram_budget``, ...).
    ``sampling``: ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``seed``,
    ``stop``, ``chat``. Leaving the loop early (``break``) closes the engine
    and drains its reads.

    >>> for piece in generate("The list type", max_tokens=8):
    ...     print(piece.text, end="")
    """
    loop = asyncio.new_event_loop()
    engine = loop.run_until_complete(Engine.open(model, **(placement or {})))
    stream = engine.generate(prompt, max_tokens=max_tokens, **sampling)
    try:
        while True:
            try:
                yield loop.run_until_complete(anext(stream))
            except StopAsyncIteration:
                return
    finally:
        loop.run_until_complete(stream.aclose())
        loop.run_until_complete(engine.aclose())
        loop.close()
