"""Sizes the user types and how many expert slots a byte budget buys.

``--ram-budget`` takes sizes such as ``512M``, ``12G``, ``1.5GiB`` or
``800MB``. Units are binary (1 K = 1024) whether or not the ``i`` is written:
memory is sized in pages, and a user who types ``12G`` for RAM means GiB.
"""
from __future__ import annotations

import math
import re

from colibri_aio.errors import UserError

_UNITS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.I)


def parse_size(text: str) -> int:
    """Bytes in a size like ``512M``, ``12G``, ``1.5GiB``, ``800MB`` or ``4096``.

    A bare number is bytes. Refuses anything else (empty, negative, unknown
    unit, fractional bytes) with a :class:`UserError` that quotes the input.
    """
    m = _SIZE.match(text)
    if m is None:
        raise UserError(f"not a size: {text!r} (examples: 512M, 12G, 1.5GiB, 800MB)")
    number, unit = m.group(1), m.group(2).upper()
    value = float(number) * 1024 ** _UNITS[unit]
    if not math.isfinite(value) or value != int(value):
        raise UserError(f"not a whole number of bytes: {text!r}")
    return int(value)


def slots_for_budget(budget_bytes: int, slot_nbytes: int, reserved_bytes: int) -> int:
    """How many expert slots of ``slot_nbytes`` fit in ``budget_bytes`` after ``reserved_bytes``.

    ``reserved_bytes`` is what the budget must also hold besides the pool (the
    resident trunk, the KV cache, working buffers). Returns 0 when nothing is
    left; the caller decides whether that is an error (it is when the model
    needs at least one slot per routed expert of a layer to make progress).
    """
    if slot_nbytes <= 0:
        raise ValueError(f"slot_nbytes must be positive, got {slot_nbytes}")
    return max(0, (budget_bytes - reserved_bytes) // slot_nbytes)
