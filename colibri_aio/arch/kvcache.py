"""The KV cache: keys and values of every layer for up to ``n_ctx`` positions, allocated once.

Stored in float16 by default, as llama.cpp does: half the memory of float32
(a Qwen3-30B-A3B file at 4096 positions: 0.375 GiB instead of 0.75 GiB) for a
rounding of each key and value to 11 significant bits. Attention reads them
back as float32. The rounding is a pure function of the value, so placement
still never changes a bit; against a float32 oracle the logits move by about
1e-3 of their range (the tolerance tests/test_arch_qwen3moe.py states).

``plan``, the start line and the allocation take their size from
:func:`kv_nbytes`, so what is printed is what is allocated.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from colibri_aio.errors import UserError

if TYPE_CHECKING:
    from colibri_aio.arch.base import KVLayout

KV_TYPES: dict[str, type[np.floating]] = {"f16": np.float16, "f32": np.float32}
DEFAULT_KV_TYPE = "f16"
# KV-cache positions when none are asked for, as llama.cpp's llama-cli: a
# Qwen3-30B-A3B file says 40960, which would reserve 3.75 GiB of f16 KV (7.5 GiB
# in f32) out of the budget the experts need.
DEFAULT_CONTEXT = 4096


def check_kv_type(kv_type: str) -> str:
    """``kv_type`` if it names a KV storage type, else a :class:`UserError` listing them."""
    if kv_type not in KV_TYPES:
        raise UserError(f"unknown --kv-type {kv_type!r} (choose from {', '.join(KV_TYPES)})")
    return kv_type


def default_context(model_context: int) -> int:
    """Positions to allocate when none are asked for: the model's, at most :data:`DEFAULT_CONTEXT`."""
    return min(model_context, DEFAULT_CONTEXT)


def kv_nbytes(n_layer: int, n_ctx: int, layout: KVLayout, kv_type: str = DEFAULT_KV_TYPE) -> int:
    """Bytes of the cache :class:`KVCache` allocates for ``layout`` stored as ``kv_type``."""
    itemsize = np.dtype(KV_TYPES[check_kv_type(kv_type)]).itemsize
    return n_layer * n_ctx * layout.floats_per_position * itemsize


class KVCache:
    """Keys (Hkv, key_width) and values (Hkv, value_width) of every layer for up to ``n_ctx`` positions,
    allocated once; with ``layout.values_in_keys`` each value is a view of its key's first numbers (MLA's latent)."""

    def __init__(self, n_layer: int, n_ctx: int, layout: KVLayout, kv_type: str = DEFAULT_KV_TYPE) -> None:
        dtype = KV_TYPES[check_kv_type(kv_type)]
        self.n_ctx, self.layout, self.kv_type = n_ctx, layout, kv_type
        self.k = np.zeros((n_layer, n_ctx, layout.heads, layout.key_width), dtype)
        self.v = (self.k[..., :layout.value_width] if layout.values_in_keys
                  else np.zeros((n_layer, n_ctx, layout.heads, layout.value_width), dtype))

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + (0 if self.layout.values_in_keys else self.v.nbytes)

    def store(self, layer: int, positions: np.ndarray, k: np.ndarray, v: np.ndarray | None) -> None:
        """Keep keys (T, Hkv, key_width) and values (T, Hkv, value_width; None when they live in the keys)
        of ``layer`` at ``positions``, rounded to the storage type."""
        self.k[layer, positions] = k
        if not self.layout.values_in_keys:
            self.v[layer, positions] = v

    def upto(self, layer: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Keys (S, Hkv, key_width) and values (S, Hkv, value_width) of ``layer`` at positions [0, stop) as float32."""
        k, v = self.k[layer, :stop], self.v[layer, :stop]
        return k.astype(np.float32, copy=False), v.astype(np.float32, copy=False)
