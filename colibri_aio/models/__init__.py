"""The small model shipped inside the package, used when no ``--model`` is given."""
from __future__ import annotations

from importlib import resources
from pathlib import Path

from colibri_aio.errors import UserError

DEFAULT_MODEL = "colibri-tiny-q8_0.gguf"


def default_model_path() -> Path:
    """Path of the shipped model file (installed as package data)."""
    path = Path(str(resources.files(__name__).joinpath(DEFAULT_MODEL)))
    if not path.is_file():
        raise UserError(f"the shipped model {DEFAULT_MODEL} is missing from {path.parent}; pass --model PATH")
    return path
