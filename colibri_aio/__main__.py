"""``python -m colibri_aio``."""
from __future__ import annotations

import sys

from colibri_aio.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
