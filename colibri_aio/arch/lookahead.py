"""Router lookahead: predict layer L+1's experts by applying router L+1 to a hidden state of layer L.

The candidate hidden states (names used in traces, statistics and ``MoETransformer.lookahead``):

- ``moe_input``: layer L's MoE input (post-attention residual after L's MoE norm);
- ``residual_next_norm``: the post-attention residual of L after L+1's MoE norm;
- ``raw_residual``: the post-attention residual of L, un-normed;
- ``layer_input_next_norm``: L's input (before attention) after L+1's MoE norm.

The first three are known when layer L routes, so their reads can overlap all
of layer L's expert compute and layer L+1's attention. The MoE norm is the
family's (``ffn_norm`` for most; ``Family.moe_norm`` names it), and the
ranking follows the family's routing (selection bias included).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from colibri_aio.kernels.ops import rms_norm, selection_scores

if TYPE_CHECKING:
    from colibri_aio.gguf.model import Model

PREDICTORS = ("moe_input", "residual_next_norm", "raw_residual", "layer_input_next_norm")


def moe_norm(model: Model, layer: int) -> np.ndarray:
    """The weight (D,) of the norm in front of block ``layer``'s MoE (and its router)."""
    return model.blocks[layer][model.family.moe_norm]


def router_logits(model: Model, layer: int, x: np.ndarray) -> np.ndarray:
    """Router ``layer``'s logits (T, E) for x (T, D): ffn_gate_inp · x, plus its bias when the file has one."""
    blk = model.blocks[layer]
    logits = x @ blk.ffn_gate_inp.T
    bias = blk.get("ffn_gate_inp.bias")
    return logits if bias is None else logits + bias


def predictor_state(model: Model, name: str, layer: int, layer_input: np.ndarray, residual: np.ndarray,
                    moe_input: np.ndarray) -> np.ndarray:
    """The hidden state (T, D) predictor ``name`` feeds to router layer + 1."""
    eps = model.args.rms_eps
    if name == "moe_input":
        return moe_input
    if name == "residual_next_norm":
        return rms_norm(residual, moe_norm(model, layer + 1), eps)
    if name == "raw_residual":
        return residual
    if name == "layer_input_next_norm":
        return rms_norm(layer_input, moe_norm(model, layer + 1), eps)
    raise ValueError(f"unknown lookahead predictor {name!r}; choose from {', '.join(PREDICTORS)}")


def rank_experts(model: Model, layer: int, states: np.ndarray, n: int) -> np.ndarray:
    """The n experts router ``layer`` would choose first for each row of ``states``: (T, n)."""
    scores = selection_scores(router_logits(model, layer, states), model.args.routing,
                              model.blocks[layer].get("exp_probs_b.bias"))
    return np.argsort(-scores, axis=-1, kind="stable")[:, :n]
