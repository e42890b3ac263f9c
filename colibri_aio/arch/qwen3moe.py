"""qwen3moe (Qwen3-30B-A3B, Qwen3-235B-A22B): per-head q/k RMSNorm, NEOX RoPE,
softmax top-k renormalised (llama.cpp always renormalises for qwen3moe).

Shape legend as in :mod:`colibri_aio.arch.layers`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from colibri_aio.arch.base import BaseArgs, Family, TensorSpec, attention_tensors, router_tensors, vector
from colibri_aio.arch.decode_graphs import GraphDecode
from colibri_aio.arch.layers import Rope
from colibri_aio.kernels.ops import rms_norm, rope_neox


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelArgs(BaseArgs):
    """qwen3moe's hyper-parameters: the shared set (``qwen3moe.*`` keys)."""


def block_tensors(a: ModelArgs, layer: int) -> list[TensorSpec]:
    return [*attention_tensors(a), vector("attn_q_norm", a.key_length), vector("attn_k_norm", a.key_length),
            *router_tensors(a)]


class Qwen3MoE(GraphDecode):
    """A qwen3moe model bound to an expert source and a KV cache; its decode steps run as whole graphs
    on the ggml backend (:mod:`colibri_aio.arch.decode_graphs`)."""

    def qk_norm(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        """RMSNorm of q or k (T, heads, d): per head."""
        return rms_norm(x, weight, self.args.rms_eps)

    def attention(self, layer: int, h: np.ndarray, positions: np.ndarray, rope: Rope) -> np.ndarray:
        blk = self.model.blocks[layer]
        q, k, v = self.qkv(blk, h)
        q = rope_neox(self.qk_norm(q, blk.attn_q_norm), *rope)
        k = rope_neox(self.qk_norm(k, blk.attn_k_norm), *rope)
        return self.attend(layer, q, k, v, positions)


FAMILY = Family("qwen3moe", ModelArgs, block_tensors, Qwen3MoE, checked_against="Qwen3MoeForCausalLM")
