"""The library's event loggers: quiet unless the application says otherwise.

Importing colibri_aio configures nothing global (the host's logging is its
own). Every module takes its logger from :func:`get_logger`, which at each
event follows structlog's configuration when the application (or the
command line, through :func:`colibri_aio.configure_logging`) has made one,
and otherwise sends warnings and errors to stderr and drops informational
events. structlog's own unconfigured default would print every event,
informational ones included, to stdout, in the middle of a script's output.
"""
from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

_QUIET_PROCESSORS = [structlog.processors.add_log_level, structlog.dev.ConsoleRenderer(colors=False)]
_Quiet = structlog.make_filtering_bound_logger(logging.WARNING)


class _Logger:
    """A logger named ``name`` whose destination is decided at each event (see the module docstring)."""

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def _target(self) -> Any:
        if structlog.is_configured():
            return structlog.get_logger(self._name)
        # stderr looked up per event: a caller may have redirected it since.
        return _Quiet(structlog.PrintLogger(sys.stderr), processors=_QUIET_PROCESSORS, context={})

    def __getattr__(self, method: str) -> Any:
        return getattr(self._target(), method)


def get_logger(name: str) -> Any:
    """The logger for module ``name``: ``log.info("event", key=value)``, structlog style."""
    return _Logger(name)


_warned: set[str] = set()


def warn_once(message: str, logger: str = "colibri_aio") -> None:
    """Log ``message`` as a warning the first time it comes up in this process (a file opened again, a
    tokenizer rebuilt, say it once)."""
    if message not in _warned:
        _warned.add(message)
        get_logger(logger).warning(message)
