"""glm4moe (GLM-4.5, GLM-4.6, GLM-4.5-Air): leading dense blocks, q/k/v biases, optional
per-head q/k RMSNorm, partial NEOX RoPE; sigmoid routing with a selection bias
(``exp_probs_b``), the chosen weights renormalised and scaled, plus a shared expert.

The file's last ``nextn_predict_layers`` blocks are the multi-token-prediction
layer: llama.cpp's main graph never runs them, and neither do we (they are
neither loaded nor planned: ``skipped_blocks``).

Shape legend as in :mod:`colibri_aio.arch.layers`; F_dense the dense blocks' FFN
width, Fs the shared expert's (expert width x expert_shared_count).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Self

from colibri_aio.arch.base import (BaseArgs, Family, Metadata, TensorSpec, attention_tensors, ffn_tensors,
                                   vector)
from colibri_aio.arch.graph import Builder, Value
from colibri_aio.arch.decode_graphs import GraphDecode
from colibri_aio.errors import ModelFormatError

# glm4moe.expert_gating_func as llama.cpp numbers it; 0 (unset) is sigmoid for this family.
_GATING = {0: "sigmoid", 1: "softmax", 2: "sigmoid"}


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelArgs(BaseArgs):
    """glm4moe's hyper-parameters: the shared set (``block_count`` without the NextN blocks),
    the dense blocks' FFN width and the shared expert count."""

    feed_forward_length: int
    expert_shared_count: int

    @classmethod
    def from_gguf(cls, meta: Metadata) -> Self:
        gating = int(meta.get("expert_gating_func", 0))
        if gating not in _GATING:
            raise ModelFormatError(f"{meta.path}: glm4moe.expert_gating_func {gating} is not supported "
                                   f"(1 softmax, 2 sigmoid)")
        if meta.get("rope.dimension_sections") is not None:
            raise ModelFormatError(f"{meta.path}: glm4moe with multimodal RoPE sections (rope.dimension_sections) "
                                   f"is a vision model; this engine runs the text models")
        routing = meta.routing(_GATING[gating])
        blocks, nextn = meta.block_count(), int(meta.get("nextn_predict_layers", 0))
        if not 0 <= nextn < blocks:
            raise ModelFormatError(f"{meta.path}: nextn_predict_layers {nextn} leaves no trunk block "
                                   f"among block_count {blocks}")
        # llama.cpp requires expert_feed_forward_length but, when it is 0, sizes the experts
        # feed_forward_length / expert_used_count wide (its glm4-moe load_arch_tensors).
        width = int(meta.need("expert_feed_forward_length")) or meta.expert_width() or 0
        return cls(**cls.common(meta, block_count=blocks - nextn, skipped_blocks=nextn, routing=routing,
                                expert_feed_forward_length=width),
                   feed_forward_length=int(meta.get("feed_forward_length", 0)),
                   expert_shared_count=int(meta.need("expert_shared_count")))

    def check(self, path: Path) -> None:
        BaseArgs.check(self, path)
        self.check_equal_head_widths(path)
        self.check_dense_width(path, self.feed_forward_length)


def block_tensors(a: ModelArgs, layer: int) -> list[TensorSpec]:
    d, e = a.embedding_length, a.expert_count
    common = [*attention_tensors(a), vector("attn_q_norm", a.key_length, optional=True),
              vector("attn_k_norm", a.key_length, optional=True),  # GLM-4.5 has them, GLM-4.5-Air not
              vector("post_attention_norm", d)]                     # the FFN's input norm (no ffn_norm)
    if not a.is_moe(layer):
        return [*common, *ffn_tensors(d, a.feed_forward_length)]
    shared = ffn_tensors(d, a.expert_feed_forward_length * a.expert_shared_count, "_shexp")
    return [*common, vector("ffn_gate_inp", e, d), vector("exp_probs_b.bias", e),
            *(shared if a.expert_shared_count else [])]


class Glm4MoE(GraphDecode):
    """A glm4moe model bound to an expert source and a KV cache."""

    args: ModelArgs

    def attention(self, f: Builder, layer: int, h: Value) -> Value:
        blk = self.model.blocks[layer]
        q, k, v = self.qkv(f, blk, h)
        if "attn_q_norm" in blk:
            q = f.rms_norm(q, blk.attn_q_norm)
        if "attn_k_norm" in blk:
            k = f.rms_norm(k, blk.attn_k_norm)
        return self.attend(f, layer, f.rope(q, neox=True), f.rope(k, neox=True), v)


FAMILY = Family("glm4moe", ModelArgs, block_tensors, Glm4MoE, checked_against="Glm4MoeForCausalLM",
                moe_norm="post_attention_norm")
