"""qwen3moe (Qwen3-30B-A3B, Qwen3-235B-A22B): per-head q/k RMSNorm, NEOX RoPE,
softmax top-k renormalised (llama.cpp always renormalises for qwen3moe).

Shape legend as in :mod:`colibri_aio.arch.layers`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Self

from colibri_aio.arch.base import (BaseArgs, Family, Metadata, TensorSpec, attention_tensors, router_tensors,
                                   vector)
from colibri_aio.arch.decode_graphs import GraphDecode
from colibri_aio.arch.graph import Builder, Value


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelArgs(BaseArgs):
    """qwen3moe's hyper-parameters: the shared set (``qwen3moe.*`` keys)."""

    @classmethod
    def from_gguf(cls, meta: Metadata) -> Self:
        # llama.cpp reads expert_feed_forward_length as optional and, absent or 0, sizes the experts
        # feed_forward_length / expert_used_count wide; a file with neither key is refused by common().
        width = meta.expert_width()
        return cls(**cls.common(meta, **({} if width is None else {"expert_feed_forward_length": width})))


def block_tensors(a: ModelArgs, layer: int) -> list[TensorSpec]:
    return [*attention_tensors(a), vector("attn_q_norm", a.key_length), vector("attn_k_norm", a.key_length),
            *router_tensors(a)]


class Qwen3MoE(GraphDecode):
    """A qwen3moe model bound to an expert source and a KV cache."""

    def qk_norm(self, f: Builder, x: Value, weight: object) -> Value:
        """RMSNorm of q or k (T, heads, d): per head."""
        return f.rms_norm(x, weight)

    def attention(self, f: Builder, layer: int, h: Value) -> Value:
        blk = self.model.blocks[layer]
        q, k, v = self.qkv(f, blk, h)
        q = f.rope(self.qk_norm(f, q, blk.attn_q_norm), neox=True)
        k = f.rope(self.qk_norm(f, k, blk.attn_k_norm), neox=True)
        return self.attend(f, layer, q, k, v)


FAMILY = Family("qwen3moe", ModelArgs, block_tensors, Qwen3MoE, checked_against="Qwen3MoeForCausalLM")
