"""Measuring this machine's speed (:class:`~colibri_aio.engine.speed.MachineSpeed`): a few seconds, once.

The kernel rates are matvecs of the engine's kernels on zero matrices; the
per-layer overhead is a decode step of the shipped model through an
:class:`~colibri_aio.engine.engine.Engine` with every expert cached. This
module runs the engine, so it sits beside it: the plan never measures, it is
handed what this module measured (``plan`` on the command line) or reads what
was kept (:func:`colibri_aio.engine.speed.cached`).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import time

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from colibri_aio.engine.engine import Engine
from colibri_aio.engine.speed import MachineSpeed, cached, decode_weights, keep
from colibri_aio.gguf.model import Model
from colibri_aio.kernels.backend import Kernels
from colibri_aio.kernels.qtensor import QTensor
from colibri_aio.logs import get_logger
from colibri_aio.models import default_model_path

log = get_logger("colibri_aio.plan")

PROBE_SHAPE = (2048, 2048)   # rows, cols of the probe matrix (an expert's is 768 x 2048 in Qwen3-30B-A3B)
PROBE_SECONDS = 0.1          # per type


def matvec_rate(kernels: Kernels, ggml_type: GGMLQuantizationType) -> float:
    """Weights per second of ``kernels``' matvec on a zero matrix of ``ggml_type``."""
    rows, cols = PROBE_SHAPE
    block, nbytes = GGML_QUANT_SIZES[ggml_type]
    w = QTensor(np.zeros(rows * cols // block * nbytes, np.uint8), ggml_type, (rows, cols))
    x = np.ones((1, cols), np.float32)
    kernels.linear(w, x)  # build the graph, touch the memory
    best, spent = float("inf"), 0.0
    while spent < PROBE_SECONDS:
        t0 = time.perf_counter()
        kernels.linear(w, x)
        dt = time.perf_counter() - t0
        best, spent = min(best, dt), spent + dt
    return rows * cols / best


def layer_overhead(kernels: Kernels) -> float:
    """Seconds per layer of a decode step of the shipped model through the engine on ``kernels``' backend,
    its products subtracted."""

    async def step() -> tuple[float, Model]:
        async with await Engine.open(default_model_path(), io="pread", prefetch="off", history=False,
                                       kernels=kernels.name) as engine:
            vocab = engine.model.args.vocab_size
            await engine.prefill([1, 2, 3, 4])
            for t in range(8):  # every expert read and cached, kernels warm
                await engine.net.forward([(5 + 7 * t) % vocab])
            times = []
            for t in range(24):
                t0 = time.perf_counter()
                await engine.net.forward([(61 + 13 * t) % vocab])
                times.append(time.perf_counter() - t0)
            return min(times), engine.model  # the least disturbed step: the machine is shared

    # Its own event loop, in a thread of its own when the caller already runs one (plan called from async code).
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        seconds, model = pool.submit(asyncio.run, step()).result()
    weights = decode_weights(model)
    products = sum(n / matvec_rate(kernels, t) for t, n in weights.items())
    return max(0.0, seconds - products) / model.args.block_count


def measure(kernels: Kernels, types: set[GGMLQuantizationType]) -> MachineSpeed:
    """Measure ``kernels``' rate for ``types`` and the per-layer overhead (a few seconds).

    A type the kernels cannot multiply (a file the loader would refuse) gets
    no rate: the plan then says its rates are assumed.
    """
    rates = {}
    for t in sorted(types):
        try:
            rates[t.name] = matvec_rate(kernels, t)
        except Exception as exc:  # noqa: BLE001 - whatever the kernel refuses, the estimate goes without it
            log.debug("no kernel speed", type=t.name, error=str(exc))
    return MachineSpeed(kernels.name, rates, layer_overhead(kernels))


def machine_speed(kernels: Kernels, types: set[GGMLQuantizationType]) -> MachineSpeed:
    """The cached measurement of ``kernels``' backend when it covers ``types``, else a new one (kept for the
    next time)."""
    speed = cached(kernels.name)
    if speed is not None and all(t.name in speed.weights_per_s for t in types):
        return speed
    known = set() if speed is None else {GGMLQuantizationType[n] for n in speed.weights_per_s}
    speed = measure(kernels, types | known)
    keep(speed)
    return speed
