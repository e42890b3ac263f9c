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

import os as _os

# The quantised kernels split rows over their own two threads; OpenBLAS threads
# inside them oversubscribe the cores (evidence/kernels_20261129T181438Z.md:
# f32 GEMV 2.83 vs 0.24 G weights/s median with OPENBLAS_NUM_THREADS=1 vs the
# default, same run). Only effective if NumPy is not imported yet; an explicit
# setting by the user wins.
_os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from colibri_aio.cli.logs import configure_default as _configure_logs  # noqa: E402

_configure_logs()

from colibri_aio.engine.engine import Engine, GenerationPiece  # noqa: E402
from colibri_aio.errors import ExpertReadError, ModelFormatError, UserError  # noqa: E402
from colibri_aio.engine.sync import generate  # noqa: E402
from colibri_aio.engine.stats import EngineStats  # noqa: E402

__all__ = ["Engine", "EngineStats", "ExpertReadError", "GenerationPiece", "ModelFormatError", "UserError",
           "generate", "__version__"]
