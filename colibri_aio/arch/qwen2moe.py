"""qwen2moe (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): q/k/v biases, NEOX RoPE, softmax top-k
without renormalisation, and a shared expert behind a sigmoid gate.

Shape legend as in :mod:`colibri_aio.arch.layers`; Fs the shared expert's width.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Self

from colibri_aio.arch.base import (BaseArgs, Family, Metadata, TensorSpec, attention_tensors, ffn_tensors,
                                   router_tensors, vector)
from colibri_aio.arch.decode_graphs import GraphDecode
from colibri_aio.arch.graph import Builder, Value
from colibri_aio.errors import ModelFormatError
from colibri_aio.kernels.ops import Routing


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelArgs(BaseArgs):
    """qwen2moe's hyper-parameters: the shared set plus the shared expert's width."""

    expert_shared_feed_forward_length: int

    @classmethod
    def from_gguf(cls, meta: Metadata) -> Self:
        # llama.cpp: experts n_ff / k wide and the shared expert n_ff wide when their keys are absent
        # or 0 (its loader tests the value, not the key's presence).
        ff = meta.get("feed_forward_length")
        expert = meta.expert_width()
        shared = meta.get("expert_shared_feed_forward_length") or ff
        for key, value in (("expert_feed_forward_length", expert), ("expert_shared_feed_forward_length", shared)):
            if value is None:
                raise ModelFormatError(f"{meta.path}: missing metadata key qwen2moe.{key} "
                                       f"(nor qwen2moe.feed_forward_length to default it from)")
        return cls(**cls.common(meta, expert_feed_forward_length=int(expert),
                                routing=Routing(normalize=False)),  # llama.cpp's qwen2moe never renormalises
                   expert_shared_feed_forward_length=int(shared))

    def check(self, path: Path) -> None:
        BaseArgs.check(self, path)
        if self.expert_shared_feed_forward_length < 1:
            raise ModelFormatError(f"{path}: expert_shared_feed_forward_length must be positive")


def block_tensors(a: ModelArgs, layer: int) -> list[TensorSpec]:
    d, fs = a.embedding_length, a.expert_shared_feed_forward_length
    return [*attention_tensors(a), *router_tensors(a),
            vector("ffn_gate_inp_shexp", d),  # stored {D, 1}: one gate logit per position
            *ffn_tensors(d, fs, "_shexp")]


class Qwen2MoE(GraphDecode):
    """A qwen2moe model bound to an expert source and a KV cache: q/k/v biases, a gated shared expert."""

    def attention(self, f: Builder, layer: int, h: Value) -> Value:
        q, k, v = self.qkv(f, self.model.blocks[layer], h)
        return self.attend(f, layer, f.rope(q, neox=True), f.rope(k, neox=True), v)


FAMILY = Family("qwen2moe", ModelArgs, block_tensors, Qwen2MoE, checked_against="Qwen2MoeForCausalLM")
