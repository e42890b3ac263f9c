"""colibri-aio: run Mixture-of-Experts models larger than RAM, straight from GGUF files.

Async::

    from colibri_aio import Engine

    async with await Engine.open("model.gguf", ram_budget="12G") as engine:
        async for piece in engine.generate("The list type", max_tokens=32):
            print(piece.text, end="", flush=True)

Plain::

    from colibri_aio import generate

    for piece in generate("The list type", max_tokens=32):
        print(piece.text, end="", flush=True)
"""
from __future__ import annotations

__version__ = "0.1.0"

from colibri_aio.cli.logs import configure_default as _configure_logs

_configure_logs()

from colibri_aio.engine.engine import Engine, GenerationPiece  # noqa: E402
from colibri_aio.errors import ExpertReadError, ModelFormatError, UserError  # noqa: E402
from colibri_aio.engine.sync import generate  # noqa: E402
from colibri_aio.engine.stats import EngineStats  # noqa: E402

__all__ = ["Engine", "EngineStats", "ExpertReadError", "GenerationPiece", "ModelFormatError", "UserError",
           "generate", "__version__"]
