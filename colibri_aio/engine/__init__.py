"""The engine: placement of experts, the scheduler that reads them, the plan, and generation.

``Engine`` and ``GenerationPiece`` are re-exported here (``from colibri_aio.engine import Engine``).
"""
from colibri_aio.cli.logs import configure_default as _configure_logs

# Before any engine module logs: unless the application configured structlog, warnings go to
# stderr (structlog's own default prints every level to stdout, into the text a script prints).
# Here rather than in the package's __init__, so that `import colibri_aio` stays instant.
_configure_logs()

from colibri_aio.engine.engine import Engine, GenerationPiece  # noqa: E402

__all__ = ["Engine", "GenerationPiece"]
