"""llama with experts (Mixtral 8x7B, 8x22B): NORM RoPE, softmax top-k renormalised.

A llama file is a mixture of experts when ``llama.expert_count`` > 0; dense llama
files are refused. The converter permuted q/k rows for NORM RoPE (adjacent
pairs), so the GGUF weights rotate as they are, without un-permuting.

Shape legend as in :mod:`colibri_aio.arch.layers`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Self

from colibri_aio.arch.base import BaseArgs, Family, Metadata, TensorSpec, attention_tensors, router_tensors
from colibri_aio.arch.decode_graphs import GraphDecode
from colibri_aio.arch.graph import Builder, Value


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelArgs(BaseArgs):
    """Mixtral's hyper-parameters: the shared set; experts are ``feed_forward_length`` wide."""

    @classmethod
    def from_gguf(cls, meta: Metadata) -> Self:
        # A dense llama has no expert_count: 0 here, refused by check() with a sentence of its own.
        return cls(**cls.common(meta, expert_count=int(meta.get("expert_count", 0)),
                                expert_used_count=int(meta.get("expert_used_count", 0)),
                                expert_feed_forward_length=int(meta.need("feed_forward_length"))))


def block_tensors(a: ModelArgs, layer: int) -> list[TensorSpec]:
    return [*attention_tensors(a), *router_tensors(a)]


class Mixtral(GraphDecode):
    """A llama model with experts (Mixtral) bound to an expert source and a KV cache: NORMAL RoPE."""

    def attention(self, f: Builder, layer: int, h: Value) -> Value:
        q, k, v = self.qkv(f, self.model.blocks[layer], h)
        return self.attend(f, layer, f.rope(q, neox=False), f.rope(k, neox=False), v)


FAMILY = Family("llama", ModelArgs, block_tensors, Mixtral, checked_against="MixtralForCausalLM")
