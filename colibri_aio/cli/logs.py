"""Event logging with structlog: to stderr, so stdout carries only generated text."""
from __future__ import annotations

import logging
import sys

import structlog


def configure(*, verbose: bool = False, json: bool = False) -> None:
    """Warnings and errors by default, info with ``verbose``; JSON lines with ``json``."""
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso"), renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO if verbose else logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )


def configure_default() -> None:
    """Unless the application configured structlog itself: warnings and errors to stderr.

    structlog's own default prints every level to stdout, which would mix
    engine events into the text a script prints.
    """
    if not structlog.is_configured():
        configure()
