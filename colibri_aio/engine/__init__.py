"""The engine: placement of experts, the scheduler that reads them, the plan, and generation.

``Engine`` and ``GenerationPiece`` are re-exported here (``from colibri_aio.engine import Engine``).
"""
from colibri_aio.engine.engine import Engine, GenerationPiece

__all__ = ["Engine", "GenerationPiece"]
