"""gpt-oss (gpt-oss-20b, gpt-oss-120b): attention with per-head sinks, a sliding window on
alternate layers, biases on q/k/v/o, YaRN RoPE (NEOX); experts chosen by router logits
(+ bias) and weighed by a softmax over the k chosen; the clamped SwiGLU with biases
on every expert projection. Experts are MXFP4 in published files.

llama.cpp's ``openai-moe`` graph is the reference (fixtures/families.md): its RoPE
floors and ceils YaRN's correction range, which transformers' gpt-oss does not.

Shape legend as in :mod:`colibri_aio.arch.layers`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Self

from colibri_aio.arch.base import BaseArgs, Family, Metadata, TensorSpec, attention_tensors, vector
from colibri_aio.arch.graph import Builder, Value
from colibri_aio.arch.decode_graphs import GraphDecode
from colibri_aio.errors import ModelFormatError
from colibri_aio.kernels.ops import Routing

# llama.cpp's default layer pattern for gpt-oss: of every 2 layers the first slides, the second sees all.
SLIDING_PATTERN = 2


def sliding_layers(meta: Metadata, block_count: int, default: int = SLIDING_PATTERN) -> tuple[bool, ...]:
    """Which blocks attend through the sliding window: ``attention.sliding_window_pattern`` as
    llama.cpp reads it (an array of flags, or a period n whose first n - 1 layers slide), else period
    ``default`` (gpt-oss's 2)."""
    pattern = meta.get("attention.sliding_window_pattern", default)
    if isinstance(pattern, list):
        if len(pattern) != block_count or not all(isinstance(p, bool) for p in pattern):
            raise ModelFormatError(f"{meta.path}: {meta.architecture}.attention.sliding_window_pattern must hold "
                                   f"one boolean per block ({block_count})")
        return tuple(pattern)
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 0:
        raise ModelFormatError(f"{meta.path}: {meta.architecture}.attention.sliding_window_pattern must be a "
                               f"non-negative integer or an array of booleans")
    return tuple(pattern == 0 or i % pattern < pattern - 1 for i in range(block_count))


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelArgs(BaseArgs):
    """gpt-oss's hyper-parameters: the shared set (RoPE scaling: YaRN), the sliding window and its layers."""

    sliding_window: int
    sliding: tuple[bool, ...]      # per block: attends through the sliding window

    @classmethod
    def from_gguf(cls, meta: Metadata) -> Self:
        values = cls.common(meta, routing=Routing(gating="softmax_weight", normalize=False))
        return cls(**values, sliding_window=int(meta.need("attention.sliding_window")),
                   sliding=sliding_layers(meta, values["block_count"]))

    def kv_window(self, layer: int) -> int | None:
        return self.sliding_window if self.sliding[layer] else None

    def check(self, path: Path) -> None:
        BaseArgs.check(self, path)
        if self.value_length != self.key_length or self.n_rot != self.key_length:
            raise ModelFormatError(f"{path}: gpt-oss heads rotate and return all their dims: key_length "
                                   f"{self.key_length}, value_length {self.value_length} and rope dims "
                                   f"{self.n_rot} must be equal")
        s = self.rope_scaling
        if s.kind == "yarn" and not (s.factor >= 1.0 and s.original_context >= 1):
            raise ModelFormatError(f"{path}: YaRN scaling of gpt-oss needs rope.scaling.factor >= 1 and "
                                   f"original_context_length >= 1 (the file says {s.factor}, {s.original_context})")
        if self.sliding_window < 1 and any(self.sliding):
            raise ModelFormatError(f"{path}: attention.sliding_window {self.sliding_window} must be positive")


def block_tensors(a: ModelArgs, layer: int) -> list[TensorSpec]:
    d, e, f = a.embedding_length, a.expert_count, a.expert_feed_forward_length
    return [*attention_tensors(a), vector("attn_output.bias", d, optional=True), vector("attn_sinks", a.head_count),
            vector("post_attention_norm", d), vector("ffn_gate_inp", e, d), vector("ffn_gate_inp.bias", e),
            # per expert, resident: small beside the experts (F + F + D floats each)
            vector("ffn_gate_exps.bias", e, f), vector("ffn_up_exps.bias", e, f), vector("ffn_down_exps.bias", e, d)]


class GptOss(GraphDecode):
    """A gpt-oss model bound to an expert source and a KV cache."""

    args: ModelArgs
    expert_activation = "swiglu_oai"   # with the ffn_{gate,up,down}_exps biases

    def attention(self, f: Builder, layer: int, h: Value) -> Value:
        blk = self.model.blocks[layer]
        q, k, v = self.qkv(f, blk, h)   # the sliding window is the cache's (ModelArgs.kv_window)
        return self.attend(f, layer, f.rope(q, neox=True), f.rope(k, neox=True), v, sinks=blk.attn_sinks)


FAMILY = Family("gpt-oss", ModelArgs, block_tensors, GptOss, checked_against="GptOssForCausalLM",
                moe_norm="post_attention_norm")
