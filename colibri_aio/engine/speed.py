"""This machine's speed for the plan's per-token estimate: what was measured here, and where it is kept.

A decoded token multiplies every resident matrix and ``k`` experts per layer
by one vector, and pays a per-layer overhead beyond the products (Python,
attention over the cache, routing, the expert source): on a tiny model that
overhead is all there is (the shipped model: ~16 ms a token where 3 G
weights/s predicted 0.4 ms). A :class:`MachineSpeed` holds both, as
:mod:`colibri_aio.engine.speed_probe` measures them:

- ``weights_per_s[type]``: the matvec of the engine's kernels (a backend) on a
  2048 x 2048 matrix of that ggml type (zeros: the kernels' time does not
  depend on the values), best of a few repeats;
- ``layer_overhead_s``: a decode step of the shipped model through the engine
  (every expert cached; its products are small) divided by its layer count,
  products subtracted.

The result is kept per backend in
``$XDG_CACHE_HOME/colibri_aio/speed/<backend>.json`` with the host it was
measured on, and measured again on another host. Without a measurement the
plan falls back to assumed rates and says so.

This module is the planning side's: it reads and writes the record and never
runs a model. Measuring opens an engine, so it lives with the engine
(:mod:`~colibri_aio.engine.speed_probe`) and hands its result to the plan.
"""
from __future__ import annotations

import importlib.util
import json
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from colibri_aio.cachefiles import cache_dir, write_atomic
from colibri_aio.logs import get_logger

log = get_logger("colibri_aio.plan")

SPEED_FORMAT, SPEED_VERSION = "colibri-aio-speed", 1


@dataclass(frozen=True, slots=True)
class MachineSpeed:
    """Measured kernel rates (weights per second, by ggml type name) and per-layer overhead of a decode step."""

    backend: str
    weights_per_s: dict[str, float]
    layer_overhead_s: float
    host: str = field(default_factory=lambda: _host())

    def rate(self, ggml_type: GGMLQuantizationType) -> float | None:
        """Weights per second for ``ggml_type``; None when it was not measured."""
        return self.weights_per_s.get(ggml_type.name)


def _host() -> str:
    return f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus"


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


def _path(name: str) -> Path:
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


def keep(speed: MachineSpeed) -> None:
    """Write ``speed`` where :func:`cached` finds it; a cache that cannot be written is one warning."""
    path = _path(speed.backend)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({"format": SPEED_FORMAT, "version": SPEED_VERSION, **asdict(speed)}).encode())
    except OSError as exc:
        log.warning(f"kernel speed not cached ({exc.filename or path.parent}: {exc.strerror or exc})")
