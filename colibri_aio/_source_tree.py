"""Running from a clone: ``colibri_aio.io``, ``colibri_aio.kernels`` and ``colibri_aio.bench`` are the clone's folders.

In a wheel, setuptools' ``package-dir`` (pyproject.toml) puts ``io/`` and
``kernels/`` inside the package, and an editable install maps them with its
own finder. But ``python -m colibri_aio`` started at the root of a clone
imports the clone's ``colibri_aio/`` first (the current folder leads
``sys.path``), whatever is installed, and that folder has no ``io/`` inside.
This finder maps the two names to the clone's folders in that case only, so
the clone's package always runs with the clone's I/O layer and kernels.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

# The same mapping as [tool.setuptools.package-dir] in pyproject.toml (a test checks they agree).
MAPPED = {"colibri_aio.bench": "bench", "colibri_aio.io": "io", "colibri_aio.kernels": "kernels"}


class SourceTreeFinder:
    """A meta path finder of the mapped subpackages in the clone's root; their submodules follow their
    ``__path__``. (No ``importlib.abc`` base class: importing it costs more than the whole package.)"""

    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> Any:
        folder = MAPPED.get(fullname)
        if folder is None:
            return None
        import importlib.util

        location = self.root / folder
        return importlib.util.spec_from_file_location(fullname, location / "__init__.py",
                                                      submodule_search_locations=[str(location)])


def install(package_dir: Path) -> bool:
    """Map the subpackages if ``package_dir`` is a clone's ``colibri_aio/`` without them; True if it did."""
    root = package_dir.parent
    if (package_dir / "io").is_dir() or not (root / "pyproject.toml").is_file():
        return False  # an installed package (the mapped folders are inside), or not a clone
    if not all((root / folder / "__init__.py").is_file() for folder in MAPPED.values()):
        return False
    if not any(isinstance(f, SourceTreeFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, SourceTreeFinder(root))
    return True
