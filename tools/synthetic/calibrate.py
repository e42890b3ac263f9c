"""Fit the routers to the written model, then patch the file in place.

Two corrections, both measured with our engine's forward pass on a few tokens:

1. The common direction. Random attention mixes every position with the same
   past, so the hidden states of one layer share a common component (measured
   on the 48-layer shape: |mean state| / RMS grows from 0.3 at layer 0 to 0.73
   at layer 47 over 16 tokens); a random router would turn it into a fixed
   per-expert offset. Each router's Gaussian part is made orthogonal to the
   mean normed state of its layer. This removes the offset, not the slow drift
   of the states along the sequence: deep layers of the random trunk still
   route more alike from token to token than early ones (see
   evidence/synthetic_gguf.md).
2. The bias scale (realistic mode). The popularity bias of expert e at layer
   L is ``c_e * p_L`` (routing.py), where ``p_L`` is the projection of the
   normed hidden state on the code channels. ``p_L``, and the spread of the
   Gaussian part of the logits (``sigma_L``), depend on how the residual stream
   grows through the layers — easier to measure than to derive. Both are
   measured at every layer and each router's code columns rescaled so that the
   bias is ``tau * sigma_L * b_e`` as designed.

Refitting layer L changes what later layers see a little, so the pass is
repeated; the history of every pass is returned (and reported) to show how far
the factors still moved.

Only ``ffn_gate_inp`` (F32) changes; every other byte of the file stays as written.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFReader

from colibri_aio.gguf.model import Model, load
from colibri_aio.engine.mapped_source import MappedExpertSource
from colibri_aio.arch import build_net
from synthetic.routing import bias_coefficients
from synthetic.tensors import CODE_CHANNELS, code_signs, tensor_rng


@dataclass
class LayerFit:
    layer: int
    projection: float   # p_L: mean of s . h_code / R over the calibration tokens
    logit_std: float    # sigma_L: std of the Gaussian part of the router logits
    factor: float       # code columns = designed columns * factor
    common: float       # |mean state| / RMS of the state (non-code channels), the share removed


class _Probe:
    """A RouteObserver that keeps each layer's MoE input (the state the router sees)."""

    def __init__(self) -> None:
        self.moe_input: dict[int, np.ndarray] = {}

    def on_layer_input(self, layer: int, x: np.ndarray) -> None:
        pass

    def on_route(self, layer: int, positions: np.ndarray, residual: np.ndarray,
                 moe_input: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> None:
        self.moe_input[layer] = moe_input.copy()


def _forward(model: Model, ids: np.ndarray) -> _Probe:
    probe = _Probe()
    net = build_net(model, MappedExpertSource(model), n_ctx=len(ids))
    asyncio.run(net.forward(ids.tolist(), observer=probe))
    return probe


def _unit_mean(h: np.ndarray) -> tuple[np.ndarray, float]:
    """The direction of the mean row of ``h`` and its length relative to the rows' RMS norm."""
    mean = h.mean(axis=0)
    norm = float(np.linalg.norm(mean))
    return mean / max(norm, 1e-30), norm / float(np.sqrt(np.mean(np.sum(h * h, axis=1))))


def _fit_layer(layer: int, h: np.ndarray, router: np.ndarray, gauss0: np.ndarray, c0: np.ndarray,
               signs: np.ndarray, logit_std: float) -> LayerFit:
    """Refit router (in place): Gaussian part orthogonal to the mean state, bias to its design."""
    r = len(signs)
    direction, common = _unit_mean(h[:, r:])
    router[:, r:] = gauss0 - np.outer(gauss0 @ direction, direction)
    p = float(np.mean(h[:, :r] @ signs) / r)
    sigma = float(np.std(h[:, r:] @ router[:, r:].T))
    factor = sigma / (logit_std * p)
    router[:, :r] = np.outer(c0 * factor, signs) / r
    return LayerFit(layer, p, sigma, factor, common)


def calibrate(path: Path, seed: int, logit_std: float, n_tokens: int = 16, passes: int = 2,
              vocab_limit: int = 2048) -> list[list[LayerFit]]:
    """Fit every router on ``n_tokens`` seeded token ids; returns the fits of every pass."""
    model = load(path)
    signs = code_signs(seed)
    assert len(signs) == CODE_CHANNELS
    # Leading dense blocks have no router.
    routers = {i: b.ffn_gate_inp for i, b in enumerate(model.blocks) if model.args.is_moe(i)}
    if not all(r.flags.writeable for r in routers.values()):
        raise RuntimeError("router arrays of the loaded model are read-only; cannot calibrate in memory")
    c0 = {i: bias_coefficients(r, signs) for i, r in routers.items()}
    gauss0 = {i: r[:, CODE_CHANNELS:].copy() for i, r in routers.items()}
    ids = tensor_rng(seed, "calibration_ids").integers(0, min(vocab_limit, model.args.vocab_size), n_tokens)
    history = []
    for _ in range(passes):
        probe = _forward(model, ids)
        history.append([_fit_layer(i, probe.moe_input[i], r, gauss0[i], c0[i], signs, logit_std)
                        for i, r in routers.items()])
    _patch_routers(path, model.reader, routers)
    return history


def _patch_routers(path: Path, reader: GGUFReader, routers: dict[int, np.ndarray]) -> None:
    """Write the routers back into the file's ffn_gate_inp tensors.

    ``reader`` is the loaded model's: parsing a 151936-token vocabulary again costs ~10 s.
    """
    offsets = {t.name: int(t.data_offset) for t in reader.tensors}
    raw = np.memmap(path, dtype=np.uint8, mode="r+")
    try:
        for i, w in routers.items():
            start = offsets[f"blk.{i}.ffn_gate_inp.weight"]
            view = raw[start: start + w.nbytes].view("<f4").reshape(w.shape)
            view[...] = w
        raw.flush()
    finally:
        del raw
