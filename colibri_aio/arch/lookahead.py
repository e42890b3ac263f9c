"""Router lookahead: predict layer L+1's experts by applying router L+1 to a hidden state of layer L.

The candidate hidden states (names used in traces, statistics and ``Qwen3MoE.lookahead``):

- ``moe_input``: layer L's MoE input (post-attention residual after L's ffn_norm);
- ``residual_next_norm``: the post-attention residual of L after L+1's ffn_norm;
- ``raw_residual``: the post-attention residual of L, un-normed;
- ``layer_input_next_norm``: L's input (before attention) after L+1's ffn_norm.

The first three are known when layer L routes, so their reads can overlap all
of layer L's expert compute and layer L+1's attention.
"""
from __future__ import annotations

import numpy as np

from colibri_aio.gguf.model import Model
from colibri_aio.kernels.ops import rms_norm

PREDICTORS = ("moe_input", "residual_next_norm", "raw_residual", "layer_input_next_norm")


def predictor_state(model: Model, name: str, layer: int, layer_input: np.ndarray, residual: np.ndarray,
                    moe_input: np.ndarray) -> np.ndarray:
    """The hidden state (T, D) predictor ``name`` feeds to router layer + 1."""
    eps, nxt = model.args.rms_eps, model.blocks[layer + 1].ffn_norm
    if name == "moe_input":
        return moe_input
    if name == "residual_next_norm":
        return rms_norm(residual, nxt, eps)
    if name == "raw_residual":
        return residual
    if name == "layer_input_next_norm":
        return rms_norm(layer_input, nxt, eps)
    raise ValueError(f"unknown lookahead predictor {name!r}; choose from {', '.join(PREDICTORS)}")


def rank_experts(router: np.ndarray, states: np.ndarray, n: int) -> np.ndarray:
    """The n experts with the largest router logits for each row of ``states``: (T, n)."""
    return np.argsort(-(states @ router.T), axis=-1, kind="stable")[:, :n]
