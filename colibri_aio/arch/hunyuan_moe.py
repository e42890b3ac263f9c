"""hunyuan-moe (Hunyuan-A13B): NEOX RoPE and then per-head q/k RMSNorm (the norm after the rotation, where
qwen3moe norms before it), softmax routing always renormalised, and a shared expert on every block.

llama.cpp's ``llama_model_hunyuan_moe`` is the reference:

- its loader requires ``expert_feed_forward_length`` but sizes the experts by ``feed_forward_length``, and
  the shared expert by ``expert_shared_feed_forward_length`` (absent or 0: ``feed_forward_length``);
- its graph fixes softmax gating and renormalisation, and scales by ``expert_weights_scale`` when present;
  expert groups apply as for every family; it has no selection bias.

Shape legend as in :mod:`colibri_aio.arch.layers`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Self

from colibri_aio.arch.base import (BaseArgs, Family, Metadata, TensorSpec, attention_tensors, ffn_tensors,
                                   router_tensors, vector)
from colibri_aio.arch.decode_graphs import GraphDecode
from colibri_aio.arch.graph import Builder, Value


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelArgs(BaseArgs):
    """hunyuan-moe's hyper-parameters: the shared set and the shared expert's width."""

    expert_shared_feed_forward_length: int

    @classmethod
    def from_gguf(cls, meta: Metadata) -> Self:
        meta.need("expert_feed_forward_length")   # required by llama.cpp's loader, which sizes experts by n_ff
        ff = int(meta.need("feed_forward_length"))
        return cls(**cls.common(meta, expert_feed_forward_length=ff,
                                routing=meta.routing("softmax", normalize=True)),
                   expert_shared_feed_forward_length=int(meta.get("expert_shared_feed_forward_length", 0)) or ff)


def block_tensors(a: ModelArgs, layer: int) -> list[TensorSpec]:
    return [*attention_tensors(a), vector("attn_q_norm", a.key_length), vector("attn_k_norm", a.key_length),
            *router_tensors(a), *ffn_tensors(a.embedding_length, a.expert_shared_feed_forward_length, "_shexp")]


class HunyuanMoE(GraphDecode):
    """A hunyuan-moe model bound to an expert source and a KV cache."""

    def attention(self, f: Builder, layer: int, h: Value) -> Value:
        blk = self.model.blocks[layer]
        q, k, v = self.qkv(f, blk, h)
        q = f.rms_norm(f.rope(q, neox=True), blk.attn_q_norm)
        k = f.rms_norm(f.rope(k, neox=True), blk.attn_k_norm)
        return self.attend(f, layer, q, k, v)


FAMILY = Family("hunyuan-moe", ModelArgs, block_tensors, HunyuanMoE, checked_against="HunYuanMoEV1ForCausalLM")
