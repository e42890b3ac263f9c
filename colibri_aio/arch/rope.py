"""RoPE scaling from the file's ``rope.scaling.*`` keys, for the families whose files may scale RoPE.

:class:`RopeScaling` reads the keys as llama.cpp does (none, linear, YaRN) and
gives the cos/sin tables and the attention scale they imply; a family's
``ModelArgs`` holds one as ``rope_scaling`` and its forward pass mixes in
:class:`ScaledRope`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Self

import numpy as np

from colibri_aio.arch.base import Metadata
from colibri_aio.arch.decode_graphs import GraphDecode
from colibri_aio.arch.graph import RopeParams
from colibri_aio.arch.layers import Rope
from colibri_aio.errors import ModelFormatError
from colibri_aio.kernels.ops import rope_cos_sin, rope_yarn_cos_sin


def _mscale(factor: float, m: float) -> float:
    """YaRN's attention magnitude 0.1·m·ln(factor) + 1 (1 when not stretched), llama.cpp's get_mscale."""
    return 1.0 if factor <= 1.0 else 0.1 * m * math.log(factor) + 1.0


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """``rope.scaling.*`` as llama.cpp reads it (deepseek2, glm4moe, gpt-oss).

    ``kind``: none, linear (angles / factor) or yarn; ``log_multiplier`` is
    mscale_all_dim (the file's yarn_log_multiplier, which the converter wrote
    times 0.1, divided by 0.1 again as llama.cpp does); ``attn_factor`` the
    optional ``rope.scaling.attn_factor``.
    """

    kind: str = "none"
    factor: float = 1.0
    original_context: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    log_multiplier: float = 0.0
    attn_factor: float = 1.0

    @classmethod
    def from_gguf(cls, meta: Metadata) -> Self:
        kind = str(meta.get("rope.scaling.type", "linear"))  # llama.cpp's default when the key is absent
        if kind not in ("none", "linear", "yarn"):
            raise ModelFormatError(f"{meta.path}: rope.scaling.type {kind!r} is not supported for "
                                   f"{meta.architecture} (none, linear, yarn)")
        factor = float(meta.get("rope.scaling.factor", 0.0) or 1.0)
        return cls(kind="none" if factor == 1.0 else kind, factor=1.0 if kind == "none" else factor,
                   original_context=int(meta.get("rope.scaling.original_context_length",
                                                 meta.need("context_length"))),
                   beta_fast=float(meta.get("rope.scaling.yarn_beta_fast", 32.0)),
                   beta_slow=float(meta.get("rope.scaling.yarn_beta_slow", 1.0)),
                   # float32 as llama.cpp divides: 0.1f / 0.1f is exactly 1
                   log_multiplier=float(np.float32(meta.get("rope.scaling.yarn_log_multiplier", 0.0))
                                        / np.float32(0.1)),
                   attn_factor=float(meta.get("rope.scaling.attn_factor", 1.0)))

    @property
    def rope_attn_factor(self) -> float:
        """llama.cpp's ``cparams.yarn_attn_factor``: the magnitude passed to its rope op."""
        if self.kind != "yarn":
            return self.attn_factor
        ratio = 1.0 if self.log_multiplier else _mscale(self.factor, 1.0)
        # deepseek2 takes mscale = mscale_all_dim, so get_mscale(f, mscale) / get_mscale(f, mscale_all_dim) = 1;
        # then llama.cpp cancels the factor ggml's rope multiplies in (1 + 0.1 ln f).
        return ratio / (1.0 + 0.1 * math.log(self.factor)) * self.attn_factor

    @property
    def rotation_magnitude(self) -> float:
        """What multiplies cos and sin: the attn factor, times ggml's own YaRN factor under yarn."""
        own = 1.0 + 0.1 * math.log(self.factor) if self.kind == "yarn" else 1.0
        return self.rope_attn_factor * own

    def kq_scale(self, head_dim: int) -> float:
        """mscale² / sqrt(dn + dr), mscale = attn_factor · (1 + 0.1 ln f) · (1 + 0.1 · log_mul · ln f)."""
        ln = math.log(self.factor)
        mscale = self.rope_attn_factor * (1.0 + 0.1 * ln) * (1.0 + 0.1 * self.log_multiplier * ln)
        return mscale * mscale / math.sqrt(head_dim)

    def params(self, n_rot: int, freq_base: float) -> RopeParams:
        """The same rotation as :meth:`tables`, as ggml's rope_ext takes it (it multiplies in its own
        1 + 0.1 ln(factor) under YaRN)."""
        yarn = self.kind == "yarn"
        return RopeParams(n_rot, freq_base, self.original_context, freq_scale=1.0 / self.factor,
                          ext_factor=1.0 if yarn else 0.0,
                          attn_factor=self.rope_attn_factor if yarn else self.rotation_magnitude,
                          beta_fast=self.beta_fast, beta_slow=self.beta_slow)

    def tables(self, positions: np.ndarray, n_rot: int, freq_base: float) -> Rope:
        if self.kind == "yarn":
            return rope_yarn_cos_sin(positions, n_rot, freq_base, factor=self.factor,
                                     original_context=self.original_context, beta_fast=self.beta_fast,
                                     beta_slow=self.beta_slow, magnitude=self.rotation_magnitude)
        cos, sin = rope_cos_sin(positions / self.factor, n_rot, freq_base)   # linear: every angle / factor
        return cos * np.float32(self.rotation_magnitude), sin * np.float32(self.rotation_magnitude)


class ScaledRope(GraphDecode):
    """A forward pass whose RoPE follows ``args.rope_scaling``."""

    def rope_tables(self, positions: np.ndarray) -> Rope:
        a = self.args
        return a.rope_scaling.tables(positions, a.n_rot, a.rope_freq_base)  # type: ignore[attr-defined]

    def rope_params(self) -> RopeParams:
        a = self.args
        return a.rope_scaling.params(a.n_rot, a.rope_freq_base)  # type: ignore[attr-defined]
