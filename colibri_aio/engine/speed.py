"""This machine's speed for the plan's per-token estimate: kernel rates measured here, cached.

A decoded token multiplies every resident matrix and ``k`` experts per layer
by one vector, and pays a per-layer overhead beyond the products (Python,
attention over the cache, routing, the expert source): on a tiny model that
overhead is all there is (the shipped model: ~16 ms a token where 3 G
weights/s predicted 0.4 ms). Both are measured here:

- ``weights_per_s[type]``: the matvec of the engine's kernels (a backend) on a
  2048 x 2048 matrix of that ggml type (zeros: the kernels' time does not
  depend on the values), best of a few repeats;
- ``layer_overhead_s``: a decode step of the shipped model through the engine
  (every expert cached; its products are small) divided by its layer count,
  products subtracted.

Measuring takes a few seconds; the result is kept per backend in
``$XDG_CACHE_HOME/colibri_aio/speed/<backend>.json`` with the host it was
measured on, and measured again on another host. Without a measurement the
plan falls back to assumed rates and says so.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from colibri_aio.cachefiles import cache_dir, write_atomic
from colibri_aio.kernels.backend import Kernels
from colibri_aio.kernels.qtensor import QTensor
from colibri_aio.logs import get_logger

log = get_logger("colibri_aio.plan")

SPEED_FORMAT, SPEED_VERSION = "colibri-aio-speed", 1
PROBE_SHAPE = (2048, 2048)   # rows, cols of the probe matrix (an expert's is 768 x 2048 in Qwen3-30B-A3B)
PROBE_SECONDS = 0.1          # per type


@dataclass(frozen=True, slots=True)
class MachineSpeed:
    """Measured kernel rates (weights per second, by ggml type name) and per-layer overhead of a decode step."""

    backend: str
    weights_per_s: dict[str, float]
    layer_overhead_s: float
    host: str = field(default_factory=lambda: _host())

    def rate(self, ggml_type: GGMLQuantizationType) -> float | None:
        return self.weights_per_s.get(ggml_type.name)


def _host() -> str:
    return f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus"


def _probe(kernels: Kernels, ggml_type: GGMLQuantizationType) -> float:
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


def _layer_overhead(kernels: Kernels) -> float:
    """Seconds per layer of a decode step of the shipped model through the engine on ``kernels``' backend,
    its products subtracted."""
    from colibri_aio.engine.engine import Engine
    from colibri_aio.models import default_model_path

    async def step() -> tuple[float, Any]:
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
    products = sum(n / _probe(kernels, t) for t, n in weights.items())
    return max(0.0, seconds - products) / model.args.block_count


def decode_weights(model: Any) -> dict[GGMLQuantizationType, int]:
    """Weights one decoded token multiplies, by ggml type: every resident matrix, ``k`` experts a layer, the head."""
    a = model.args
    out: dict[GGMLQuantizationType, int] = {}

    def add(t: GGMLQuantizationType, n: int) -> None:
        out[t] = out.get(t, 0) + n

    for layer, blk in enumerate(model.blocks):
        for m in blk.matrices():
            add(m.ggml_type, m.rows * m.cols)
        for r in (model.experts[layer][0].ranges if model.experts[layer] else ()):  # a dense block: none
            add(r.ggml_type, a.expert_used_count * int(np.prod(r.shape)))
    add(model.output.ggml_type, model.output.rows * model.output.cols)
    return out


def measure(kernels: Kernels, types: set[GGMLQuantizationType]) -> MachineSpeed:
    """Measure ``kernels``' rate for ``types`` and the per-layer overhead (a few seconds).

    A type the kernels cannot multiply (a file the loader would refuse) gets
    no rate: the plan then says its rates are assumed.
    """
    rates = {}
    for t in sorted(types):
        try:
            rates[t.name] = _probe(kernels, t)
        except Exception as exc:  # noqa: BLE001 - whatever the kernel refuses, the estimate goes without it
            log.debug("no kernel speed", type=t.name, error=str(exc))
    return MachineSpeed(kernels.name, rates, _layer_overhead(kernels))


def _path(name: str):
    return cache_dir("speed", f"{name}.json")


def default_backend() -> str:
    """The backend ``--kernels auto`` picks where ggml-python is installed, told without loading it."""
    return "ggml" if importlib.util.find_spec("ggml") is not None else "numpy"


def cached(backend: str | None = None) -> MachineSpeed | None:
    """The measurement kept for ``backend`` (None: :func:`default_backend`) on this host, or None."""
    try:
        doc = json.loads(_path(backend or default_backend()).read_text())
        if doc.pop("format") != SPEED_FORMAT or doc.pop("version") != SPEED_VERSION:
            return None
        speed = MachineSpeed(**doc)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    return speed if speed.host == _host() else None


def machine_speed(kernels: Kernels, types: set[GGMLQuantizationType]) -> MachineSpeed:
    """The cached measurement of ``kernels``' backend when it covers ``types``, else a new one (kept for the
    next time)."""
    speed = cached(kernels.name)
    if speed is not None and all(t.name in speed.weights_per_s for t in types):
        return speed
    known = set() if speed is None else {GGMLQuantizationType[n] for n in speed.weights_per_s}
    speed = measure(kernels, types | known)
    path = _path(speed.backend)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({"format": SPEED_FORMAT, "version": SPEED_VERSION, **asdict(speed)}).encode())
    except OSError as exc:
        log.warning(f"kernel speed not cached ({exc.filename or path.parent}: {exc.strerror or exc})")
    return speed
