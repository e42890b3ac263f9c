"""olmoe (OLMoE-1B-7B): q/k RMSNorm over the whole projection (before the split into
heads), NEOX RoPE, softmax top-k without renormalisation.

Shape legend as in :mod:`colibri_aio.arch.layers`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Self

import numpy as np

from colibri_aio.arch.base import BaseArgs, Family, Metadata, TensorSpec, attention_tensors, router_tensors, vector
from colibri_aio.arch.layers import MoETransformer, Rope
from colibri_aio.kernels.ops import Routing, rms_norm, rope_neox


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelArgs(BaseArgs):
    """olmoe's hyper-parameters: the shared set; experts are ``feed_forward_length`` wide."""

    @classmethod
    def from_gguf(cls, meta: Metadata) -> Self:
        # olmoe files have no expert_feed_forward_length: llama.cpp sizes the experts by n_ff.
        return cls(**cls.common(meta, expert_feed_forward_length=int(meta.need("feed_forward_length")),
                                routing=Routing(normalize=False)))  # llama.cpp never renormalises for olmoe


def block_tensors(a: ModelArgs, layer: int) -> list[TensorSpec]:
    # q/k norms span the whole projection (transformers' OlmoeAttention; llama.cpp sizes both n_embd,
    # which only files with head_count_kv == head_count satisfy).
    return [*attention_tensors(a), vector("attn_q_norm", a.head_count * a.key_length),
            vector("attn_k_norm", a.head_count_kv * a.key_length), *router_tensors(a)]


def _norm_heads(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of (T, heads, d) over heads * d, the projection before its split."""
    return rms_norm(x.reshape(x.shape[0], -1), weight, eps).reshape(x.shape)


class OLMoE(MoETransformer):
    """An olmoe model bound to an expert source and a KV cache."""

    def attention(self, layer: int, h: np.ndarray, positions: np.ndarray, rope: Rope) -> np.ndarray:
        a, blk = self.args, self.model.blocks[layer]
        q, k, v = self.qkv(blk, h)
        q = rope_neox(_norm_heads(q, blk.attn_q_norm, a.rms_eps), *rope)
        k = rope_neox(_norm_heads(k, blk.attn_k_norm, a.rms_eps), *rope)
        return self.attend(layer, q, k, v, positions)


FAMILY = Family("olmoe", ModelArgs, block_tensors, OLMoE, checked_against="OlmoeForCausalLM")
