"""``python -m colibri_aio``: run, chat, serve, logits, trace, trace-stats, replay, plot, plan, doctor, iobench.

Each command is a module of this package named for it (``trace-stats`` is
``trace_stats``), which declares its options (``add_parser``) and runs it;
this one assembles them into one parser and owns what every command shares:
the exit statuses and signal handling.

One error path for every command (:func:`main`):

- a user mistake or a broken input (:class:`UserError`, an output file that
  cannot be written) is one line on stderr and exit status 2, whichever task
  raised it (exception groups are unwrapped); so is a mistake argparse finds;
- an I/O fault while streaming an expert is one line naming file, offset and
  expert, exit status 1;
- Ctrl-C (SIGINT) and SIGTERM both stop the work the same way: reads in
  flight are drained and the usage history is saved; exit 130 and 143;
- a reader that goes away (``run ... | head``) ends the run quietly (141).

The options several commands share are :mod:`colibri_aio.cli.options`'s,
the output files :mod:`colibri_aio.cli.outfiles`'s and the event loop
(SIGTERM within it) :mod:`colibri_aio.cli.loop`'s.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import IO, NoReturn

from colibri_aio import __version__
from colibri_aio.errors import ExpertReadError, UserError, one_line
from colibri_aio.cli import chat, doctor, iobench, logits, plan, plot, repack, replay, run, serve, trace, trace_stats
from colibri_aio.cli.logs import configure as configure_logs
from colibri_aio.cli.loop import Terminated

EXIT_USER, EXIT_IO, EXIT_INTERRUPTED, EXIT_PIPE, EXIT_TERMINATED = 2, 1, 130, 141, 143


class _Parser(argparse.ArgumentParser):
    """argparse with its mistakes reported as one line, like every other mistake."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USER, f"colibri-aio: error: {self.prog.removeprefix('python -m colibri_aio ')}: {message} "
                             f"(see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The parser of the whole command line: the global options and one subcommand per command module."""
    parser = _Parser(
        prog="python -m colibri_aio",
        description="Run Mixture-of-Experts models larger than RAM, straight from GGUF files.")
    parser.add_argument("--version", action="version", version=f"colibri-aio {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine events (backend choice, placement)")
    parser.add_argument("--log-json", action="store_true", help="write logs to stderr as JSON lines")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # The order of `--help`'s list of commands.
    for module in (run, chat, serve, logits, trace, trace_stats, replay, plot, plan, doctor, iobench, repack):
        module.add_parser(sub)
    return parser


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    """The exceptions inside (nested) exception groups, in order; ``exc`` itself if it is not a group."""
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


def _first(exc: BaseException, kind: type[BaseException] | tuple[type[BaseException], ...]) -> BaseException | None:
    return next((e for e in _leaves(exc) if isinstance(e, kind)), None)


def _silence_stdout() -> None:
    """After a broken pipe: point stdout at /dev/null, so the flush at exit does not complain again."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def exit_status(exc: BaseException, err: IO[str]) -> int:
    """The exit status for ``exc`` (after one line on ``err`` where one is due); re-raises a bug."""
    if _first(exc, Terminated):
        return EXIT_TERMINATED
    if _first(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if _first(exc, BrokenPipeError):
        _silence_stdout()
        return EXIT_PIPE
    if (found := _first(exc, UserError)) is not None:
        print(f"colibri-aio: error: {one_line(found)}", file=err)
        return EXIT_USER
    if (found := _first(exc, ExpertReadError)) is not None:
        print(f"colibri-aio: I/O error: {one_line(found)}", file=err)
        return EXIT_IO
    found = _first(exc, OSError)
    if isinstance(found, OSError) and found.filename is not None:  # a file the user named or a place to write
        print(f"colibri-aio: error: {one_line(f'{found.filename}: {found.strerror or found}')}", file=err)
        return EXIT_USER
    if isinstance(found, OSError) and found.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        # Standard output on a full disk: the text the run wrote there is lost, and the interpreter's own flush
        # at exit would fail again (a second report), so stdout goes to /dev/null first.
        _silence_stdout()
        print(f"colibri-aio: error: cannot write the output ({found.strerror})", file=err)
        return EXIT_USER
    raise exc


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


@contextlib.contextmanager
def _sigterm_as_exception() -> Iterator[None]:
    """Outside the event loop, SIGTERM raises :class:`Terminated` (like SIGINT raises KeyboardInterrupt)."""
    try:
        before = signal.signal(signal.SIGTERM, _raise_terminated)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (see the module's docstring)."""
    with _sigterm_as_exception():
        try:
            args = build_parser().parse_args(argv)
            configure_logs(verbose=args.verbose, json=args.log_json)
            func: Callable[[argparse.Namespace], int] = args.func
            return func(args)
        except SystemExit:
            raise
        except BaseException as exc:  # noqa: BLE001 - sorted by exit_status, bugs re-raised
            return exit_status(exc, sys.stderr)
