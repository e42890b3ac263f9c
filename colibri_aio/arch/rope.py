"""RoPE scaling read from GGUF metadata (``<arch>.rope.scaling.*``): YaRN as llama.cpp applies it.

A family whose files may carry ``rope.scaling.type = yarn`` reads a :class:`Yarn`
with :meth:`Yarn.from_gguf` and builds its cos/sin tables with
:meth:`Yarn.tables`; the attention factor llama.cpp puts on the tables differs
per family, so the family passes the magnitude it needs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from colibri_aio.errors import ModelFormatError
from colibri_aio.kernels.ops import rope_yarn_cos_sin

if TYPE_CHECKING:
    from colibri_aio.arch.base import Metadata


@dataclass(frozen=True, slots=True)
class Yarn:
    """YaRN's parameters: frequencies divided by ``factor`` beyond the context the model was trained on."""

    factor: float
    original_context: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attn_factor: float = 1.0   # rope.scaling.attn_factor: one more factor llama.cpp puts on the tables

    @classmethod
    def from_gguf(cls, meta: Metadata) -> Yarn | None:
        """The file's YaRN scaling, None when it has no RoPE scaling; other scaling types are refused."""
        kind = meta.get("rope.scaling.type", "none")
        if kind == "none":
            return None
        if kind != "yarn":
            raise ModelFormatError(f"{meta.path}: rope.scaling.type {kind!r} is not supported for "
                                   f"{meta.architecture} (this engine runs yarn or none)")
        factor = float(meta.need("rope.scaling.factor"))
        original = int(meta.get("rope.scaling.original_context_length", meta.need("context_length")))
        yarn = cls(factor, original, float(meta.get("rope.scaling.yarn_beta_fast", 32.0)),
                   float(meta.get("rope.scaling.yarn_beta_slow", 1.0)),
                   float(meta.get("rope.scaling.attn_factor", 1.0)))
        if factor < 1.0 or original < 1:
            raise ModelFormatError(f"{meta.path}: YaRN needs rope.scaling.factor >= 1 and an original context "
                                   f"length >= 1 (the file says {factor} and {original})")
        return yarn

    @property
    def magnitude(self) -> float:
        """The factor on cos and sin of a file without ``rope.scaling.yarn_log_multiplier``.

        ggml's ``rope_yarn`` multiplies by YaRN's 1 + 0.1 ln factor; llama.cpp's context sets its
        attention factor to 1 + 0.1 ln factor, divides it by the same, and multiplies by
        ``rope.scaling.attn_factor``: what is left is attn_factor · (1 + 0.1 ln factor).
        """
        return self.attn_factor * (1.0 + 0.1 * math.log(self.factor))

    def tables(self, positions: np.ndarray, n_rot: int, freq_base: float,
               magnitude: float) -> tuple[np.ndarray, np.ndarray]:
        """cos/sin (T, n_rot/2) for ``positions``, multiplied by ``magnitude``."""
        return rope_yarn_cos_sin(positions, n_rot, freq_base, factor=self.factor,
                                 original_context=self.original_context, beta_fast=self.beta_fast,
                                 beta_slow=self.beta_slow, magnitude=magnitude)
