"""Placement plans: a fixed matrix of budgets with their expected plans, and refusals."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from colibri_aio.errors import UserError
from colibri_aio.gguf.model import ModelArgs
from colibri_aio.engine.memory import MemoryLimits
from colibri_aio.engine.plan import kv_cache_nbytes, make_plan, working_nbytes

from support import fixture, run_cli

GiB, MiB = 1 << 30, 1 << 20
# Qwen3-30B-A3B in Q8_0: 48 layers x 128 experts, one expert = 3 x 768 x 2048 weights at 34/32 bytes.
QWEN3_30B = SimpleNamespace(
    args=ModelArgs("qwen3moe", 151936, 40960, 2048, 48, 32, 4, 128, 128, 1e6, 1e-6, 128, 8, 768, False),
    trunk_nbytes=1_480_000_000,
    expert_nbytes_max=3 * 768 * 2048 * 34 // 32,
)
SLOT = -(-3 * 768 * 2048 * 34 // 32 // 4096) * 4096 + 6 * 4096  # aligned up + O_DIRECT slack
LIMITS = MemoryLimits(total=24 * GiB, available=22 * GiB, cgroup_limit=None, cgroup_source="none")


def _reserved(context: int) -> int:
    return QWEN3_30B.trunk_nbytes + kv_cache_nbytes(QWEN3_30B, context) + working_nbytes(QWEN3_30B)


@pytest.mark.parametrize("budget,context,slots,bottleneck", [
    (4 * GiB, 4096, (4 * GiB - _reserved(4096)) // SLOT, "disk"),     # 285 of 6144 experts
    (12 * GiB, 4096, (12 * GiB - _reserved(4096)) // SLOT, "disk"),   # 1990: a third of the experts
    (12 * GiB, 32768, (12 * GiB - _reserved(32768)) // SLOT, "disk"),  # a longer context costs slots
    (40 * GiB, 4096, 6144, "compute"),                                 # every expert fits
])
def test_budget_matrix(budget: int, context: int, slots: int, bottleneck: str) -> None:
    plan = make_plan(QWEN3_30B, LIMITS, budget=budget, context=context)
    assert plan.slot_nbytes == SLOT
    assert plan.slots == slots and plan.bottleneck == bottleneck
    assert plan.kv_cache == 2 * 48 * context * 4 * 128 * 4
    assert plan.trunk + plan.kv_cache + plan.working + plan.pool <= budget
    assert plan.all_experts_fit == (slots == 48 * 128)


def test_expected_matrix_values_are_the_ones_written_down() -> None:
    """The first rows above, spelled out, so a change of the arithmetic shows."""
    assert SLOT == 5_038_080
    assert make_plan(QWEN3_30B, LIMITS, budget=4 * GiB, context=4096).slots == 285
    assert make_plan(QWEN3_30B, LIMITS, budget=12 * GiB, context=4096).slots == 1990


def test_default_budget_follows_the_cgroup_limit() -> None:
    limited = MemoryLimits(total=24 * GiB, available=22 * GiB, cgroup_limit=8 * GiB, cgroup_source="memory.max")
    plan = make_plan(QWEN3_30B, limited, context=4096)
    assert plan.budget == int(8 * GiB * 0.85) and "cgroup" in plan.budget_source


def test_usage_history_gives_an_expected_hit_rate() -> None:
    counts = {(layer, e): (100.0 if e < 16 else 1.0) for layer in range(48) for e in range(128)}
    plan = make_plan(QWEN3_30B, LIMITS, budget=12 * GiB, context=4096, usage_counts=counts, pin_share=0.5)
    hot = 48 * 16 * 100.0
    assert plan.expected_hit_rate == pytest.approx((hot + (plan.slots - 48 * 16)) / (hot + 48 * 112))
    assert plan.pinned_slots == plan.slots // 2


def test_planted_over_budget_is_refused() -> None:
    with pytest.raises(UserError, match="too small"):
        make_plan(QWEN3_30B, LIMITS, budget=1 * GiB, context=4096)


def test_plan_cli(tmp_path) -> None:
    r = run_cli("plan", str(fixture("tiny_q8_0.gguf")), "--ram-budget", "512M", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["budget"] == 512 * MiB and doc["all_experts_fit"] and doc["slots"] == 16
    r = run_cli("plan", str(fixture("tiny_q8_0.gguf")), "--ram-budget", "64M")
    assert r.returncode == 2 and "too small" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = run_cli("plan", str(fixture("tiny_q8_0.gguf")))
    assert r.returncode == 0 and "expert pool" in r.stdout and "bound by" in r.stdout
