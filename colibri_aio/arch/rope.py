"""RoPE tables from the file's ``rope.scaling.*`` keys, for the families whose files may scale RoPE.

:class:`~colibri_aio.arch.deepseek2.RopeScaling` reads the keys as llama.cpp
does (none, linear, YaRN); a family's ``ModelArgs`` holds one as ``rope_scaling``
and its forward pass mixes in :class:`ScaledRope`.
"""
from __future__ import annotations

import numpy as np

from colibri_aio.arch.layers import MoETransformer, Rope


class ScaledRope(MoETransformer):
    """A forward pass whose cos/sin tables follow ``args.rope_scaling``."""

    def rope_tables(self, positions: np.ndarray) -> Rope:
        a = self.args
        return a.rope_scaling.tables(positions, a.n_rot, a.rope_freq_base)  # type: ignore[attr-defined]
