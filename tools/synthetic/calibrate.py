"""Fit the realistic routers' bias to the written model, then patch the file in place.

The popularity bias of expert e at layer L is ``c_e * p_L`` (routing.py), where
``p_L`` is the projection of the normed hidden state on the code channels. How
large ``p_L`` is, and how widely the Gaussian part of the logits spreads
(``sigma_L``), depends on how the residual stream grows through the layers —
something easier to measure than to derive. So: run our engine's forward pass
on a few tokens, measure ``p_L`` and ``sigma_L`` at every layer, and rescale
each router's code columns so that the bias is ``tau * sigma_L * b_e`` as
designed. Rescaling layer L changes what later layers see a little, so the pass
is repeated; the last pass reports how far the factors still moved.

Only the code columns of ``ffn_gate_inp`` (F32) change; every other byte of the
file stays as written.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFReader

from colibri_aio.gguf_model import Model, load
from colibri_aio.mapped_source import MappedExpertSource
from colibri_aio.qwen3moe import Qwen3MoE
from synthetic.routing import bias_coefficients
from synthetic.tensors import CODE_CHANNELS, code_signs, tensor_rng


@dataclass
class LayerFit:
    layer: int
    projection: float   # p_L: mean of s . h_code / R over the calibration tokens
    logit_std: float    # sigma_L: std of the Gaussian part of the router logits
    factor: float       # code columns = designed columns * factor


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
    net = Qwen3MoE(model, MappedExpertSource(model), n_ctx=len(ids))
    asyncio.run(net.forward(ids.tolist(), observer=probe))
    return probe


def _fit_layer(layer: int, h: np.ndarray, router: np.ndarray, c0: np.ndarray, signs: np.ndarray,
               logit_std: float) -> LayerFit:
    r = len(signs)
    p = float(np.mean(h[:, :r] @ signs) / r)
    sigma = float(np.std(h[:, r:] @ router[:, r:].T))
    factor = sigma / (logit_std * p)
    router[:, :r] = np.outer(c0 * factor, signs) / r
    return LayerFit(layer, p, sigma, factor)


def calibrate(path: Path, seed: int, logit_std: float, n_tokens: int = 8, passes: int = 2,
              vocab_limit: int = 2048) -> list[list[LayerFit]]:
    """Fit every router's bias on ``n_tokens`` seeded token ids; returns the fits of every pass."""
    model = load(path)
    signs = code_signs(seed)
    assert len(signs) == CODE_CHANNELS
    routers = [b.ffn_gate_inp for b in model.blocks]
    if not all(r.flags.writeable for r in routers):
        raise RuntimeError("router arrays of the loaded model are read-only; cannot calibrate in memory")
    c0 = [bias_coefficients(r, signs) for r in routers]
    ids = tensor_rng(seed, "calibration_ids").integers(0, min(vocab_limit, model.args.vocab_size), n_tokens)
    history = []
    for _ in range(passes):
        probe = _forward(model, ids)
        history.append([_fit_layer(i, probe.moe_input[i], routers[i], c0[i], signs, logit_std)
                        for i in range(model.args.block_count)])
    _patch_routers(path, model.reader, routers)
    return history


def _patch_routers(path: Path, reader: GGUFReader, routers: list[np.ndarray]) -> None:
    """Write the routers' code columns back into the file's ffn_gate_inp tensors.

    ``reader`` is the loaded model's: parsing a 151936-token vocabulary again costs ~10 s.
    """
    offsets = {t.name: int(t.data_offset) for t in reader.tensors}
    raw = np.memmap(path, dtype=np.uint8, mode="r+")
    try:
        for i, w in enumerate(routers):
            start = offsets[f"blk.{i}.ffn_gate_inp.weight"]
            view = raw[start: start + w.nbytes].view("<f4").reshape(w.shape)
            view[:, :CODE_CHANNELS] = w[:, :CODE_CHANNELS]
        raw.flush()
    finally:
        del raw
