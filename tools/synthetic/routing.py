"""Router weights (ffn_gate_inp) for the two routing modes.

uniform
    Each router is an independent Gaussian matrix (made blind to the layer's
    mean hidden state by calibrate.py): every expert is equally likely and
    consecutive layers' choices are unrelated. The worst case for a cache.
realistic
    The same Gaussian part (now correlated from layer to layer) plus a
    per-expert *popularity* bias, so that expert use is skewed as in a trained
    model, the popular experts of consecutive layers overlap, and the next
    layer's router applied to this layer's state predicts its choice.

qwen3moe routers have no bias term, so the bias rides on the code channels
(tensors.CODE_CHANNELS): the router columns over them are ``outer(c, s) / R``,
giving expert e the logit ``c_e * p`` where ``p = s . h_code / R`` is the
(nearly token-independent) projection of the normed hidden state on the code.
``p`` and the spread of the Gaussian part of the logits depend on how the
residual stream grows, which is measured on the written file and corrected by
calibrate.py. Before calibration ``c`` assumes p = 1.

The bias strength is chosen so that the *population* expert-use entropy (over
many tokens, normalised by log E) hits a target; it is solved by Monte Carlo
on the model "logit = tau * b_e + N(0, 1)" with standardised profiles b.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from synthetic.shapes import Shape
from synthetic.tensors import CODE_CHANNELS, code_signs, tensor_rng

MODES = ("uniform", "realistic")


@dataclass(frozen=True)
class RoutingTargets:
    """What the realistic mode aims for (the uniform mode uses only ``logit_std``).

    The entropy target is set so that a trace of the 8-layer cut lands where
    the trained colibri-tiny model's routing is on the same text (expert-use
    entropy 0.70-0.79, top-10% share 0.46-0.66, locality 2.6-4.3x the uniform
    k/E, next-layer recall@k ~0.83; evidence/synthetic_gguf.md). The overlaps
    between consecutive layers are chosen, not measured: popular experts partly
    shared by neighbouring layers, as published analyses of trained MoEs show.
    """

    entropy: float = 0.80       # population expert-use entropy / log(E)
    bias_corr: float = 0.6      # correlation of consecutive layers' popularity profiles
    router_corr: float = 0.5    # correlation of consecutive layers' Gaussian router parts
    logit_std: float = 1.0      # std of the Gaussian part of the router logits

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def _selection_stats(tau: float, profiles: np.ndarray, noise: np.ndarray, k: int) -> tuple[float, float]:
    """(normalised entropy, top-10% share) of top-k selections under logits tau*b + noise."""
    ents, shares = [], []
    e = profiles.shape[1]
    for b in profiles:
        top = np.argpartition(-(tau * b + noise), k - 1, axis=1)[:, :k]
        counts = np.bincount(top.ravel(), minlength=e).astype(np.float64)
        p = counts / counts.sum()
        nz = p[p > 0]
        ents.append(-(nz * np.log(nz)).sum() / math.log(e))
        shares.append(np.sort(counts)[::-1][: max(1, math.ceil(0.1 * e))].sum() / counts.sum())
    return float(np.mean(ents)), float(np.mean(shares))


def solve_bias_scale(e: int, k: int, entropy: float, seed: int, tokens: int = 4000,
                     n_profiles: int = 4) -> tuple[float, float]:
    """tau (in units of the Gaussian logit std) giving the target entropy, and the top-10% share there."""
    rng = tensor_rng(seed, "solve_bias_scale")
    profiles = _standardise(rng.standard_normal((n_profiles, e)))
    noise = rng.standard_normal((tokens, e))  # common random numbers: entropy(tau) is monotone
    lo, hi = 0.0, 8.0
    for _ in range(30):
        mid = 0.5 * (lo + hi)
        if _selection_stats(mid, profiles, noise, k)[0] > entropy:
            lo = mid
        else:
            hi = mid
    tau = 0.5 * (lo + hi)
    return tau, _selection_stats(tau, profiles, noise, k)[1]


def _standardise(b: np.ndarray) -> np.ndarray:
    """Rows with mean 0 and std 1."""
    b = b - b.mean(axis=-1, keepdims=True)
    return b / b.std(axis=-1, keepdims=True)


def _correlated(prev: np.ndarray | None, fresh: np.ndarray, rho: float) -> np.ndarray:
    """rho * prev + sqrt(1 - rho^2) * fresh: a unit-variance sequence with lag-1 correlation rho."""
    return fresh if prev is None else rho * prev + math.sqrt(1.0 - rho * rho) * fresh


@dataclass
class RouterSet:
    """Routers of every layer, and what they were designed from."""

    routers: list[np.ndarray]            # [layer] (E, D) float32
    mode: str
    targets: RoutingTargets
    bias_scale: float                    # tau; 0 in uniform mode
    expected_top10_share: float


def make_routers(shape: Shape, mode: str, targets: RoutingTargets, seed: int) -> RouterSet:
    """Routers for ``mode``; layer i depends only on layers <= i, so cuts agree with the full model."""
    if mode not in MODES:
        raise ValueError(f"routing mode must be one of {MODES}, got {mode!r}")
    e, d, r = shape.expert_count, shape.embedding_length, CODE_CHANNELS
    realistic = mode == "realistic"
    tau, share = (solve_bias_scale(e, shape.expert_used_count, targets.entropy, seed) if realistic
                  else (0.0, math.ceil(0.1 * e) / e))
    signs = code_signs(seed)
    routers, gauss, bias = [], None, None
    for i in range(shape.block_count):
        rng = tensor_rng(seed, f"blk.{i}.ffn_gate_inp")
        fresh = rng.standard_normal((e, d - r))
        gauss = _correlated(gauss, fresh, targets.router_corr if realistic else 0.0)
        w = np.zeros((e, d), np.float32)
        # Over the non-code channels the normed state has RMS ~1: logits of std logit_std.
        w[:, r:] = gauss * (targets.logit_std / math.sqrt(d - r))
        if realistic:
            bias = _correlated(bias, _standardise(rng.standard_normal(e)), targets.bias_corr)
            w[:, :r] = np.outer(tau * targets.logit_std * _standardise(bias), signs) / r
        routers.append(w)
    return RouterSet(routers, mode, targets, tau, share)


def bias_coefficients(router: np.ndarray, signs: np.ndarray) -> np.ndarray:
    """c such that router[:, :R] == outer(c, signs) / R."""
    return router[:, : len(signs)] @ signs
