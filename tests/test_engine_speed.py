"""The plan's per-token estimate from this machine's measured speed, checked against a real run."""
from __future__ import annotations

import asyncio
import json
import time

from colibri_aio.engine.engine import Engine
from colibri_aio.engine.memory import MemoryLimits
from colibri_aio.engine.plan import make_plan
from colibri_aio.engine.speed import cached, decode_weights
from colibri_aio.engine.speed_probe import machine_speed, measure
from colibri_aio.gguf.model import load
from colibri_aio.kernels.backend import open_kernels
from colibri_aio.models import default_model_path

from support import fixture

GiB = 1 << 30
LIMITS = MemoryLimits(total=24 * GiB, available=20 * GiB, cgroup_limit=None, cgroup_source=None)


def _decode_step_s(path, ids: list[int]) -> float:
    """Fewest seconds of a decode step of the engine on ``path``, every expert cached (no reads)."""
    async def run() -> float:
        async with await Engine.open(path, io="pread", prefetch="off", history=False) as engine:
            engine.net.reset()
            await engine.prefill(ids[:8])
            for t in ids[8:12]:  # reach the steady state: every expert read, kernels warm
                await engine.net.forward([t])
            times = []
            for t in ids[12:]:
                t0 = time.perf_counter()
                await engine.net.forward([t])
                times.append(time.perf_counter() - t0)
            return min(times)  # the least disturbed step, as the measurement takes it

    return asyncio.run(run())


def test_estimate_is_within_2x_of_a_real_run() -> None:
    """The shipped model, the one whose per-token estimate was 40x off with assumed rates, through the engine
    (the overhead is measured without its scheduler). Tolerance: a factor of 2 either way."""
    model = load(default_model_path(), resident=False)
    tries = []
    # Both sides are timings on a shared machine: a disturbed measurement (seen once in a full suite: the
    # overhead probe 9x below a quiet run's) is taken again, up to three times; a wrong estimate fails all three.
    for _ in range(3):
        kernels = open_kernels("auto")  # what the engine below runs
        try:
            speed = measure(kernels, set(decode_weights(model)))
        finally:
            kernels.close()
        plan = make_plan(model, LIMITS, budget=1 * GiB, speed=speed)
        assert plan.all_experts_fit and "measured" in plan.speed_source
        real = _decode_step_s(model.path, [(7 * i) % model.args.vocab_size for i in range(1, 40)])
        tries.append((real, plan.compute_s_per_token, speed))
        if 0.5 <= real / plan.compute_s_per_token <= 2.0:
            return
    raise AssertionError(f"estimate not within 2x of a real run in 3 tries: {tries}")


def test_without_a_measurement_the_plan_says_its_rates_are_assumed() -> None:
    model = load(fixture("tiny_q8_0.gguf"), resident=False)
    plan = make_plan(model, LIMITS, budget=1 * GiB)
    assert plan.speed_source.startswith("assumed")


def test_speed_is_measured_once_and_kept_for_this_host(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = load(fixture("tiny_q8_0.gguf"), resident=False)
    kernels = open_kernels("auto")
    assert cached(kernels.name) is None
    types = set(decode_weights(model))
    try:
        first = machine_speed(kernels, types)
        assert cached(kernels.name) == first and machine_speed(kernels, types) == first  # the second measures nothing
    finally:
        kernels.close()
    path = next((tmp_path / "colibri_aio" / "speed").glob("*.json"))
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({**doc, "host": "another machine"}))
    assert cached(kernels.name) is None  # measured elsewhere: not this machine's speed
    path.write_text("{not json")
    assert cached(kernels.name) is None
