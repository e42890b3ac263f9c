"""``python -m colibri_aio``."""
from __future__ import annotations

import sys

EXIT_INTERRUPTED = 130  # cli.main.EXIT_INTERRUPTED, which an interrupted import never defines


def _forget_caught_interrupt() -> None:
    """Keep CPython from ending the process by SIGINT after a KeyboardInterrupt the program caught.

    CPython notes a KeyboardInterrupt that leaves code run by ``exec`` of a
    string (``PyRun_StringFlags``; ``dataclasses`` builds every ``__init__``
    that way while a module is imported) and, at exit, kills itself with
    SIGINT (status -2) whatever the program returned, even though the
    interrupt was caught further up. The next ``exec`` of a string clears the
    note, so an empty one here lets the program's own exit status stand.
    """
    exec("")


def entry() -> int:
    """The program: `python -m colibri_aio` and the `colibri-aio` script."""
    # Importing the CLI pulls in NumPy and the engine (about a second): Ctrl-C
    # meanwhile ends the program as quietly as Ctrl-C during a command does.
    try:
        from colibri_aio.cli.main import main
    except KeyboardInterrupt:
        _forget_caught_interrupt()
        return EXIT_INTERRUPTED
    try:
        status = main()
    except KeyboardInterrupt:  # between the import and main()'s own handling
        status = EXIT_INTERRUPTED
    if status == EXIT_INTERRUPTED:
        _forget_caught_interrupt()
    return status


if __name__ == "__main__":
    sys.exit(entry())
