"""ernie4_5-moe (ERNIE-4.5-21B-A3B, ERNIE-4.5-300B-A47B): Llama's attention (normal RoPE on consecutive
pairs, no q/k norm), leading dense blocks, softmax routing with a selection bias (``exp_probs_b``, ERNIE's
``moe_statics``), the chosen weights always renormalised, plus a shared expert when the file has one.

llama.cpp's ``llama_model_ernie4_5_moe`` is the reference:

- its graph fixes softmax gating and renormalisation whatever the file says, and scales by
  ``expert_weights_scale`` when present (0 or 1: unscaled); expert groups apply as for every family;
- its loader gives every block from ``leading_dense_block_count`` on a router and experts, while its graph
  runs experts only on blocks with ``(i + 1) % interleave_moe_layer_step == 0``: with a step other than 1
  it would run a dense FFN it never loaded, so such a file is refused here;
- the shared expert is ``expert_shared_feed_forward_length`` wide (absent or 0: none);
- it loads an optional ``attn_output.bias`` but its graph never adds it, and neither do we.

Shape legend as in :mod:`colibri_aio.arch.layers`.
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


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelArgs(BaseArgs):
    """ernie4_5-moe's hyper-parameters: the shared set, the dense blocks' FFN width and the shared expert's."""

    feed_forward_length: int
    expert_shared_feed_forward_length: int

    @classmethod
    def from_gguf(cls, meta: Metadata) -> Self:
        step = int(meta.need("interleave_moe_layer_step"))
        if step != 1:
            raise ModelFormatError(f"{meta.path}: ernie4_5-moe.interleave_moe_layer_step {step}: llama.cpp loads "
                                   f"experts on every block after the leading dense ones and runs them only on "
                                   f"every {step}th, so it cannot run this file; published ERNIE-4.5 MoE files have 1")
        return cls(**cls.common(meta, routing=meta.routing("softmax", normalize=True)),
                   feed_forward_length=int(meta.get("feed_forward_length", 0)),
                   expert_shared_feed_forward_length=int(meta.get("expert_shared_feed_forward_length", 0)))

    def check(self, path: Path) -> None:
        BaseArgs.check(self, path)
        self.check_equal_head_widths(path)
        self.check_dense_width(path, self.feed_forward_length)


def block_tensors(a: ModelArgs, layer: int) -> list[TensorSpec]:
    d, shared = a.embedding_length, a.expert_shared_feed_forward_length
    common = [*attention_tensors(a), vector("attn_output.bias", d, optional=True)]
    if not a.is_moe(layer):
        return [*common, vector("ffn_norm", d), *ffn_tensors(d, a.feed_forward_length)]
    return [*common, *router_tensors(a), vector("exp_probs_b.bias", a.expert_count, optional=True),
            *(ffn_tensors(d, shared, "_shexp") if shared else [])]


class Ernie45MoE(GraphDecode):
    """An ernie4_5-moe model bound to an expert source and a KV cache."""

    def attention(self, f: Builder, layer: int, h: Value) -> Value:
        blk = self.model.blocks[layer]
        q, k, v = self.qkv(f, blk, h)
        o = f.attend(layer, f.rope(q, neox=False), f.rope(k, neox=False), v)
        return f.linear(blk.attn_output, o)  # attn_output.bias, when loaded, is not added (as llama.cpp)


FAMILY = Family("ernie4_5-moe", ModelArgs, block_tensors, Ernie45MoE, checked_against="Ernie4_5_MoeForCausalLM")
