"""``python -m colibri_aio``."""
from __future__ import annotations

import sys


def entry() -> int:
    """The program: `python -m colibri_aio` and the `colibri-aio` script."""
    # Importing the CLI pulls in NumPy and the engine (about a second): Ctrl-C
    # meanwhile ends the program as quietly as Ctrl-C during a command does.
    try:
        from colibri_aio.cli.main import EXIT_INTERRUPTED, main
    except KeyboardInterrupt:
        return 130
    try:
        return main()
    except KeyboardInterrupt:  # between the import and main()'s own handling
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(entry())
