"""The engine: placement of experts, the scheduler that reads them, the plan, and generation.

``Engine`` and ``GenerationPiece`` are re-exported here (``from colibri_aio.engine import Engine``).
Importing it configures no logging: that is the application's (or the command line's) to do.
"""
from colibri_aio.engine.engine import Engine, GenerationPiece

__all__ = ["Engine", "GenerationPiece"]
