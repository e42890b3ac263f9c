"""olmoe (OLMoE-1B-7B): qwen3moe's attention with the q/k RMSNorm over the whole
projection (before the split into heads), NEOX RoPE, softmax top-k without renormalisation.

Shape legend as in :mod:`colibri_aio.arch.layers`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Self

from colibri_aio.arch.base import BaseArgs, Family, Metadata, TensorSpec, attention_tensors, router_tensors, vector
from colibri_aio.arch.graph import Builder, Value
from colibri_aio.arch.qwen3moe import Qwen3MoE
from colibri_aio.kernels.ops import Routing


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


class OLMoE(Qwen3MoE):
    """An olmoe model bound to an expert source and a KV cache: q/k normed over the whole projection."""

    def qk_norm(self, f: Builder, x: Value, weight: object) -> Value:
        """RMSNorm of q or k (T, heads, d) over heads * d: the projection before its split."""
        heads = len(weight) // self.args.key_length  # type: ignore[arg-type]
        return f.heads(f.rms_norm(f.flat(x), weight), heads, self.args.key_length)


FAMILY = Family("olmoe", ModelArgs, block_tensors, OLMoE, checked_against="OlmoeForCausalLM")
