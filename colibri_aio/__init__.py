"""colibri-aio: run Mixture-of-Experts models larger than RAM, straight from GGUF files.

Async::

    from colibri_aio import Engine

    async with await Engine.open("model.gguf", ram_budget="12G") as engine:
        async for piece in engine.generate("The list type", max_tokens=32):
            print(piece.text, end="", flush=True)

Plain (no event loop of your own; works inside one too, e.g. in Jupyter)::

    from colibri_aio import SyncEngine

    with SyncEngine.open("model.gguf") as engine:   # the model is opened once
        for piece in engine.generate("The list type", max_tokens=32):
            print(piece.text, end="", flush=True)

or, for one generation, ``colibri_aio.generate("The list type", max_tokens=32)``.

Importing the package configures nothing global: its events go through
structlog as the application configured it; with no configuration, warnings
and errors go to stderr and informational events are dropped.
``configure_logging()`` applies the command line's setup (warnings and errors
to stderr, ``verbose=True`` for informational events).
"""
from __future__ import annotations

__version__ = "0.1.0"

from pathlib import Path as _Path

from colibri_aio import _source_tree

_source_tree.install(_Path(__file__).resolve().parent)

# The public names load on first use (PEP 562): the engine pulls in NumPy and the
# kernels, which ``python -m colibri_aio --help`` and a Ctrl-C at start need not wait for.
_EXPORTS = {
    "Engine": "colibri_aio.engine.engine", "GenerationPiece": "colibri_aio.engine.engine",
    "EngineStats": "colibri_aio.engine.stats", "SyncEngine": "colibri_aio.engine.sync",
    "generate": "colibri_aio.engine.sync", "EngineBusyError": "colibri_aio.errors",
    "ExpertReadError": "colibri_aio.errors", "ModelFormatError": "colibri_aio.errors",
    "NonFiniteError": "colibri_aio.errors", "UserError": "colibri_aio.errors",
    "configure_logging": "colibri_aio.cli.logs",
    "SamplingParams": "colibri_aio.text.sampling",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):  # noqa: ANN202 - PEP 562
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'colibri_aio' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
