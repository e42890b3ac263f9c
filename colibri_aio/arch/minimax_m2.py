"""minimax-m2 (MiniMax-M2, MiniMax-M2.1): q/k RMSNorm over the whole projection, partial NEOX RoPE
(``rope.dimension_count`` of each head), sigmoid routing with a selection bias (``exp_probs_b``), the
chosen weights renormalised (llama.cpp's ``minimax-m2`` graph always renormalises) and never scaled.

llama.cpp's ``llama_model_minimax_m2`` is the reference: the gating function comes from the file
(``expert_gating_func``, written by the converter from the config's ``scoring_func``); a file without
it cannot be run by llama.cpp either (its graph aborts), so it is refused here in one line. Its loader
reads no ``expert_weights_scale`` (the weight scale stays 0: unscaled), so a file that has the key is
run unscaled here too, as llama.cpp runs it (tests/test_arch_minimax_m2.py).

Shape legend as in :mod:`colibri_aio.arch.layers`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Self

from colibri_aio.arch.base import BaseArgs, Family, Metadata, TensorSpec, attention_tensors, router_tensors, vector
from colibri_aio.arch.olmoe import OLMoE
from colibri_aio.kernels.ops import Routing

# minimax-m2.expert_gating_func as llama.cpp numbers it.
_GATING = {1: "softmax", 2: "sigmoid"}


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelArgs(BaseArgs):
    """minimax-m2's hyper-parameters: the shared set, its routing read from the file."""

    @classmethod
    def from_gguf(cls, meta: Metadata) -> Self:
        ff = meta.get("expert_feed_forward_length")   # one per block: Metadata.get reads it as one width
        routing = Routing(meta.gating(_GATING), normalize=True, scale=0.0)   # expert_weights_scale: not read
        overrides = {"routing": routing}
        if ff is not None:
            overrides["expert_feed_forward_length"] = int(ff)
        return cls(**cls.common(meta, **overrides))


def block_tensors(a: ModelArgs, layer: int) -> list[TensorSpec]:
    # q/k norms span the whole projection, q's and k's widths (llama.cpp: n_embd_head_k * n_head, n_embd_k_gqa)
    return [*attention_tensors(a), vector("attn_q_norm", a.head_count * a.key_length),
            vector("attn_k_norm", a.head_count_kv * a.key_length), *router_tensors(a),
            vector("exp_probs_b.bias", a.expert_count)]


class MiniMaxM2(OLMoE):
    """A minimax-m2 model bound to an expert source and a KV cache: olmoe's attention (q/k normed over the
    whole projection, NEOX RoPE, here on the first n_rot dims of each head), routing by ``args.routing``.
    Its description is olmoe's: nothing of the block is written again."""


FAMILY = Family("minimax-m2", ModelArgs, block_tensors, MiniMaxM2, checked_against="MiniMaxM2ForCausalLM")
