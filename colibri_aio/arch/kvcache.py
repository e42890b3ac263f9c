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

import numpy as np

from colibri_aio.errors import UserError

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


def kv_shape(n_layer: int, n_ctx: int, n_kv: int, head_dim: int) -> tuple[int, int, int, int]:
    """Shape of the keys (and of the values): (layers, positions, KV heads, head dim)."""
    return (n_layer, n_ctx, n_kv, head_dim)


def kv_nbytes(n_layer: int, n_ctx: int, n_kv: int, head_dim: int, kv_type: str = DEFAULT_KV_TYPE) -> int:
    """Bytes of keys and values together, as :class:`KVCache` allocates them."""
    itemsize = np.dtype(KV_TYPES[check_kv_type(kv_type)]).itemsize
    return 2 * int(np.prod(kv_shape(n_layer, n_ctx, n_kv, head_dim))) * itemsize


class KVCache:
    """Keys and values of every layer for up to ``n_ctx`` positions, allocated once."""

    def __init__(self, n_layer: int, n_ctx: int, n_kv: int, head_dim: int, kv_type: str = DEFAULT_KV_TYPE) -> None:
        dtype = KV_TYPES[check_kv_type(kv_type)]
        self.n_ctx, self.kv_type = n_ctx, kv_type
        shape = kv_shape(n_layer, n_ctx, n_kv, head_dim)
        self.k = np.zeros(shape, dtype)
        self.v = np.zeros(shape, dtype)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def store(self, layer: int, positions: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Keep ``k`` and ``v`` (T, Hkv, d) of ``layer`` at ``positions`` (rounded to the storage type)."""
        self.k[layer, positions] = k
        self.v[layer, positions] = v

    def upto(self, layer: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of ``layer`` at positions [0, stop) as float32 (S, Hkv, d)."""
        k, v = self.k[layer, :stop], self.v[layer, :stop]
        return k.astype(np.float32, copy=False), v.astype(np.float32, copy=False)
