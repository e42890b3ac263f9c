"""Event logging with structlog: to stderr, so stdout carries only generated text.

The command line calls :func:`configure` once, at start; importing the
package never does (a library must not change its host's logging).
"""
from __future__ import annotations

import logging
import sys

import structlog


def configure(*, verbose: bool = False, json: bool = False) -> None:
    """Events to stderr: warnings and errors by default, info with ``verbose``; JSON lines with ``json``."""
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso"), renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO if verbose else logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )


configure_logging = configure  # the name ``colibri_aio`` exports it under
