"""RoPE scaling from the file's ``rope.scaling.*`` keys, read for every family as llama.cpp reads them.

:class:`RopeScaling` reads the keys as llama.cpp's loader does for every
architecture (none, linear, YaRN; the older ``rope.scale_linear``) and gives the
cos/sin tables and the attention scale they imply. ``BaseArgs.rope_scaling``
holds one for each family, and the shared forward pass
(``MoETransformer.rope_tables`` / ``rope_params``) rotates by it on both
backends, so no family has a RoPE that ignores the file.

What llama.cpp reads for the families here (src/llama-model.cpp's common
loader): ``rope.scaling.type`` (absent: linear), ``rope.scaling.factor`` (absent:
``rope.scale_linear``; 0 or absent: 1), ``rope.scaling.original_context_length``
(absent or 0: ``context_length``) and ``rope.scaling.attn_factor``. Their own
loaders read no ``rope.scaling.yarn_beta_*``, ``yarn_attn_factor`` or
``yarn_ext_factor`` (only grok's and mistral3's do), so YaRN's ramp runs between
llama.cpp's default betas 32 and 1 whatever the file says; only deepseek2 reads
``rope.scaling.yarn_log_multiplier``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Self

import numpy as np

from colibri_aio.arch.graph import RopeParams
from colibri_aio.errors import ModelFormatError
from colibri_aio.kernels.ops import rope_cos_sin, rope_yarn_cos_sin

if TYPE_CHECKING:
    from colibri_aio.arch.base import Metadata
    from colibri_aio.arch.layers import Rope

# What llama.cpp's rope_scaling_type_from_string knows besides the three run here; any other value aborts it.
_LONGROPE = "longrope"
_RUN = ("none", "linear", "yarn")


def _mscale(factor: float, m: float) -> float:
    """YaRN's attention magnitude 0.1·m·ln(factor) + 1 (1 when not stretched), llama.cpp's get_mscale."""
    return 1.0 if factor <= 1.0 else 0.1 * m * math.log(factor) + 1.0


def _scaling_type(meta: Metadata) -> str:
    """``rope.scaling.type`` (llama.cpp's default when absent: linear); one llama.cpp does not run for the
    family is refused in one line."""
    kind = str(meta.get("rope.scaling.type", "linear"))
    if kind in _RUN:
        return kind
    if kind == _LONGROPE:
        # llama.cpp applies LongRoPE's per-dimension factors (rope_factors_long/short) only in the families
        # that load those tensors (phi3 & co); for this one it would rotate as if unscaled.
        why = "llama.cpp applies LongRoPE's frequency factors only to families that load them"
    else:
        why = "llama.cpp knows none, linear, yarn and longrope"
    raise ModelFormatError(f"{meta.path}: rope.scaling.type {kind!r} is not supported for {meta.architecture} "
                           f"(this engine runs none, linear and yarn; {why})")


def _scaling_factor(meta: Metadata) -> float:
    """``rope.scaling.factor``, else the older ``rope.scale_linear`` (llama.cpp reads it only when the first
    is absent); 0 or neither is 1. The angles are multiplied by 1 / factor (llama.cpp's freq_scale)."""
    factor = meta.get("rope.scaling.factor")
    if factor is None:
        factor = meta.get("rope.scale_linear", 0.0)
    factor = float(factor) or 1.0
    if not (math.isfinite(factor) and factor > 0.0):
        raise ModelFormatError(f"{meta.path}: rope.scaling.factor {factor} must be positive")
    return factor


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """``rope.scaling.*`` as llama.cpp reads it; the default is unscaled RoPE.

    ``kind``: none, linear (angles / factor) or yarn; ``log_multiplier`` is
    mscale_all_dim (the file's yarn_log_multiplier, which the converter wrote
    times 0.1, divided by 0.1 again as llama.cpp does; only deepseek2 reads it);
    ``attn_factor`` the optional ``rope.scaling.attn_factor``.
    """

    kind: str = "none"
    factor: float = 1.0
    original_context: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    log_multiplier: float = 0.0
    attn_factor: float = 1.0

    @classmethod
    def from_gguf(cls, meta: Metadata, *, log_multiplier: bool = False) -> Self:
        """The scaling of the file as llama.cpp runs the family; ``log_multiplier``: the family reads
        ``rope.scaling.yarn_log_multiplier`` (llama.cpp's deepseek2)."""
        kind, factor = _scaling_type(meta), _scaling_factor(meta)
        if kind == "none" or factor == 1.0:   # llama.cpp: freq_scale 1; YaRN at factor 1 rotates as none
            kind, factor = "none", 1.0
        original = int(meta.get("rope.scaling.original_context_length", 0)) or int(meta.need("context_length"))
        # float32 as llama.cpp divides: 0.1f / 0.1f is exactly 1
        log_mul = (float(np.float32(meta.get("rope.scaling.yarn_log_multiplier", 0.0)) / np.float32(0.1))
                   if log_multiplier else 0.0)
        return cls(kind=kind, factor=factor, original_context=original, log_multiplier=log_mul,
                   attn_factor=float(meta.get("rope.scaling.attn_factor", 1.0)))

    @property
    def rope_attn_factor(self) -> float:
        """llama.cpp's ``cparams.yarn_attn_factor``: the magnitude passed to its rope op.

        Under YaRN llama.cpp starts from get_mscale(factor, 1) = 1 + 0.1 ln f, or with a log multiplier
        (deepseek2, which takes mscale = mscale_all_dim) from get_mscale(f, mscale) / get_mscale(f,
        mscale_all_dim) = 1, and divides out the 1 + 0.1 ln f that ggml's rope multiplies in. So the
        families without the key rotate with magnitude 1 + 0.1 ln f (transformers' YaRN attention factor on
        cos and sin), deepseek2 with 1 and its mscale² on the softmax scale (:meth:`kq_scale`).
        """
        if self.kind != "yarn":
            return self.attn_factor
        ratio = 1.0 if self.log_multiplier else _mscale(self.factor, 1.0)
        return ratio / (1.0 + 0.1 * math.log(self.factor)) * self.attn_factor

    @property
    def rotation_magnitude(self) -> float:
        """What multiplies cos and sin: the attn factor, times ggml's own YaRN factor under yarn."""
        own = 1.0 + 0.1 * math.log(self.factor) if self.kind == "yarn" else 1.0
        return self.rope_attn_factor * own

    def kq_scale(self, head_dim: int) -> float:
        """mscale² / sqrt(dn + dr), mscale = attn_factor · (1 + 0.1 ln f) · (1 + 0.1 · log_mul · ln f)
        (deepseek2's softmax scale)."""
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
        """cos/sin (T, n_rot/2) of ``positions``: the angles :meth:`params` describes."""
        if self.kind == "yarn":
            return rope_yarn_cos_sin(positions, n_rot, freq_base, factor=self.factor,
                                     original_context=self.original_context, beta_fast=self.beta_fast,
                                     beta_slow=self.beta_slow, magnitude=self.rotation_magnitude)
        if self.kind == "none" and self.attn_factor == 1.0:
            return rope_cos_sin(positions, n_rot, freq_base)
        cos, sin = rope_cos_sin(positions / self.factor, n_rot, freq_base)   # linear: every angle / factor
        return cos * np.float32(self.rotation_magnitude), sin * np.float32(self.rotation_magnitude)
