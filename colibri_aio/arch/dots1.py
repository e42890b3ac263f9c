"""dots1 (dots.llm1): qwen3moe's attention (per-head q/k RMSNorm, NEOX RoPE, no biases) on DeepSeek-V3's
MoE: leading dense blocks, sigmoid routing with a selection bias (``exp_probs_b``) and expert groups, the
chosen weights renormalised and scaled as the file says, plus a shared expert on every MoE block.

llama.cpp's ``llama_model_dots1`` is the reference. Its graph takes the gating function from the file
(``expert_gating_func``, which the converter writes only from a config's ``scoring_func``) and aborts on a
file without one, so such a file is refused here in one line. Its loader requires the shared expert
(``expert_shared_count`` experts wide), so a file without it is refused too.

Shape legend as in :mod:`colibri_aio.arch.layers`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Self

from colibri_aio.arch.base import (BaseArgs, Family, Metadata, TensorSpec, attention_tensors, ffn_tensors,
                                   router_tensors, vector)
from colibri_aio.arch.qwen3moe import Qwen3MoE
from colibri_aio.errors import ModelFormatError

# dots1.expert_gating_func as llama.cpp numbers it (0, absent, makes its graph abort).
_GATING = {1: "softmax", 2: "sigmoid"}


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelArgs(BaseArgs):
    """dots1's hyper-parameters: the shared set, the dense blocks' FFN width and the shared expert count."""

    feed_forward_length: int
    expert_shared_count: int

    @classmethod
    def from_gguf(cls, meta: Metadata) -> Self:
        return cls(**cls.common(meta, routing=meta.routing(meta.gating(_GATING))),
                   feed_forward_length=int(meta.get("feed_forward_length", 0)),
                   expert_shared_count=int(meta.need("expert_shared_count")))

    def check(self, path: Path) -> None:
        BaseArgs.check(self, path)
        self.check_equal_head_widths(path)
        if self.head_count_kv != self.head_count:
            raise ModelFormatError(f"{path}: dots1 with head_count_kv {self.head_count_kv} != head_count "
                                   f"{self.head_count}: llama.cpp's dots1 loader sizes keys and values for "
                                   f"every head, so no llama.cpp-readable file has fewer")
        if self.expert_shared_count < 1:
            raise ModelFormatError(f"{path}: dots1.expert_shared_count {self.expert_shared_count}: every dots1 "
                                   f"MoE block has a shared expert")
        self.check_dense_width(path, self.feed_forward_length)


def block_tensors(a: ModelArgs, layer: int) -> list[TensorSpec]:
    d = a.embedding_length
    common = [*attention_tensors(a), vector("attn_q_norm", a.key_length), vector("attn_k_norm", a.key_length)]
    if not a.is_moe(layer):
        return [*common, vector("ffn_norm", d), *ffn_tensors(d, a.feed_forward_length)]
    return [*common, *router_tensors(a), vector("exp_probs_b.bias", a.expert_count, optional=True),
            *ffn_tensors(d, a.expert_feed_forward_length * a.expert_shared_count, "_shexp")]


class Dots1(Qwen3MoE):
    """A dots1 model bound to an expert source and a KV cache: qwen3moe's attention, written once there;
    the dense blocks, the shared expert and the routing come with the tensors and ``args.routing``."""


FAMILY = Family("dots1", ModelArgs, block_tensors, Dots1, checked_against="Dots1ForCausalLM")
