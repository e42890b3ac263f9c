"""Placement plans: a fixed matrix of budgets with their expected plans, and refusals."""
from __future__ import annotations

import json
import os
import re
from types import SimpleNamespace

import pytest

from colibri_aio.errors import UserError
from colibri_aio.gguf.model import ModelArgs
from colibri_aio.engine.memory import MemoryLimits
from colibri_aio.engine.plan import kv_cache_nbytes, make_plan, working_nbytes
from colibri_aio.policy.usage import MIN_TOKENS

from sparse_gguf import write_sparse_qwen3moe
from support import fixture, run_cli

GiB, MiB = 1 << 30, 1 << 20
# Qwen3-30B-A3B in Q8_0: 48 layers x 128 experts, one expert = 3 x 768 x 2048 weights at 34/32 bytes.
QWEN3_30B = SimpleNamespace(
    args=ModelArgs("qwen3moe", 151936, 40960, 2048, 48, 32, 4, 128, 128, 1e6, 1e-6, 128, 8, 768, False),
    trunk_nbytes=1_480_000_000,
    block_matrix_weights=48 * 2 * (32 + 4) * 128 * 2048,  # attn_q/k/v/output of every block
    expert_nbytes_max=3 * 768 * 2048 * 34 // 32,
)
SLOT = -(-3 * 768 * 2048 * 34 // 32 // 4096) * 4096 + 6 * 4096  # aligned up + O_DIRECT slack
LIMITS = MemoryLimits(total=24 * GiB, available=22 * GiB, cgroup_limit=None, cgroup_source="none")
BIG = MemoryLimits(total=64 * GiB, available=60 * GiB, cgroup_limit=None, cgroup_source="none")


def _reserved(context: int) -> int:
    return QWEN3_30B.trunk_nbytes + kv_cache_nbytes(QWEN3_30B, context) + working_nbytes(QWEN3_30B)


def _per_layer(slots: int) -> int:
    """The cache gives all 48 layers the same quota: slots that do not divide are not allocated."""
    return slots // 48 * 48


@pytest.mark.parametrize("budget,context,slots,bottleneck", [
    (4 * GiB, 4096, _per_layer((4 * GiB - _reserved(4096)) // SLOT), "disk"),     # 336 of 6144 experts
    (12 * GiB, 4096, _per_layer((12 * GiB - _reserved(4096)) // SLOT), "disk"),   # 2064: a third of them
    (12 * GiB, 32768, _per_layer((12 * GiB - _reserved(32768)) // SLOT), "disk"),  # a longer context costs slots
    (40 * GiB, 4096, 6144, "compute"),                                             # every expert fits
])
def test_budget_matrix(budget: int, context: int, slots: int, bottleneck: str) -> None:
    plan = make_plan(QWEN3_30B, BIG, budget=budget, context=context)
    assert plan.slot_nbytes == SLOT
    assert plan.slots == slots and plan.bottleneck == bottleneck
    assert plan.kv_cache == 2 * 48 * context * 4 * 128 * 2  # f16 keys and values
    assert plan.trunk + plan.kv_cache + plan.working + plan.pool <= budget
    assert plan.all_experts_fit == (slots == 48 * 128)


def test_expected_matrix_values_are_the_ones_written_down() -> None:
    """The first rows above, spelled out, so a change of the arithmetic shows."""
    assert SLOT == 5_038_080
    assert make_plan(QWEN3_30B, LIMITS, budget=4 * GiB, context=4096).slots == 336    # 365 fit, 7 per layer
    assert make_plan(QWEN3_30B, LIMITS, budget=12 * GiB, context=4096).slots == 2064  # 2070 fit, 43 per layer


def test_default_budget_follows_the_cgroup_limit() -> None:
    limited = MemoryLimits(total=24 * GiB, available=22 * GiB, cgroup_limit=8 * GiB, cgroup_source="memory.max")
    plan = make_plan(QWEN3_30B, limited, context=4096)
    assert plan.budget == int(8 * GiB * 0.85) and "cgroup" in plan.budget_source


def test_usage_history_gives_an_expected_hit_rate() -> None:
    counts = {(layer, e): (100.0 if e < 16 else 1.0) for layer in range(48) for e in range(128)}
    plan = make_plan(QWEN3_30B, LIMITS, budget=12 * GiB, context=4096, usage_counts=counts, pin_share=0.5,
                     history_tokens=MIN_TOKENS)
    hot = 48 * 16 * 100.0
    assert plan.expected_hit_rate == pytest.approx((hot + (plan.slots - 48 * 16)) / (hot + 48 * 112))
    fit = (12 * GiB - _reserved(4096)) // SLOT
    assert plan.pinned_slots == fit // 2 and (plan.slots - plan.pinned_slots) % 48 == 0


def test_a_short_usage_history_gives_no_hit_rate() -> None:
    """A history of a few positions has seen few experts: they would all seem to fit, so the plan says so."""
    counts = {(layer, e): 1.0 for layer in range(48) for e in range(8)}
    plan = make_plan(QWEN3_30B, LIMITS, budget=12 * GiB, context=4096, usage_counts=counts,
                     history_tokens=MIN_TOKENS - 1)
    assert plan.expected_hit_rate is None and "too few" in plan.hit_rate_source
    plan = make_plan(QWEN3_30B, LIMITS, budget=12 * GiB, context=4096, usage_counts=counts,
                     history_tokens=MIN_TOKENS)
    assert plan.expected_hit_rate == 1.0 and plan.hit_rate_source == "usage history"


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
    r = run_cli("plan", str(fixture("tiny_q8_0.gguf")))       # every expert fits: auto keeps them in the page cache
    experts_row = next(line for line in r.stdout.splitlines() if line.startswith("experts in "))
    assert r.returncode == 0 and "the page cache: 16 experts" in experts_row and "bound by" in r.stdout
    assert "into the page cache, whole layers" in r.stdout and "expert pool" not in r.stdout
    r = run_cli("plan", str(fixture("tiny_q8_0.gguf")), "--cache-per-layer", "2")  # not all fit: a pool
    assert r.returncode == 0 and "expert pool" in r.stdout and "page cache" not in r.stdout


def test_cache_per_layer_is_what_the_plan_counts() -> None:
    """--cache-per-layer 8 on 48 layers is 384 slots, pins on top of each layer's quota: the plan says so."""
    plan = make_plan(QWEN3_30B, LIMITS, budget=8 * GiB, context=4096, cache_per_layer=8)
    assert plan.slots == 384 and plan.pinned_slots == 0 and "pool 384 slots" in plan.one_line()
    counts = {(0, 0): 1.0}
    pinned = make_plan(QWEN3_30B, LIMITS, budget=8 * GiB, context=4096, cache_per_layer=8, usage_counts=counts,
                       pin_share=0.5)
    assert (pinned.slots, pinned.pinned_slots) == (384 + 4 * 48, 4 * 48)
    with pytest.raises(UserError, match="--cache-per-layer"):
        make_plan(QWEN3_30B, LIMITS, budget=4 * GiB, context=4096, cache_per_layer=128)


def test_a_budget_above_the_machine_is_refused_naming_both_figures() -> None:
    with pytest.raises(UserError, match=r"--ram-budget 30.00 GiB is more than this machine's RAM 24.00 GiB"):
        make_plan(QWEN3_30B, LIMITS, budget=30 * GiB, context=4096)
    limited = MemoryLimits(total=24 * GiB, available=22 * GiB, cgroup_limit=8 * GiB, cgroup_source="memory.max")
    with pytest.raises(UserError, match=r"10.00 GiB is more than the cgroup memory limit 8.00 GiB \(memory.max\)"):
        make_plan(QWEN3_30B, limited, budget=10 * GiB, context=4096)
    busy = MemoryLimits(total=24 * GiB, available=6 * GiB, cgroup_limit=None, cgroup_source="none")
    plan = make_plan(QWEN3_30B, busy, budget=8 * GiB, context=4096)
    assert any("8.00 GiB is more than the 6.00 GiB available now" in n for n in plan.notes)


def test_context_default_clamp_and_refusal() -> None:
    default = make_plan(QWEN3_30B, LIMITS, budget=12 * GiB)
    assert default.context == 4096 and "default" in default.context_source     # not the model's 40960
    clamped = make_plan(QWEN3_30B, LIMITS, budget=12 * GiB, context=100_000)
    assert clamped.context == 40960 and clamped.notes == (
        "--ctx 100000 is more than the model's context_length 40960: using 40960",)
    for bad in (0, -5):
        with pytest.raises(UserError, match="--ctx must be >= 1"):
            make_plan(QWEN3_30B, LIMITS, budget=12 * GiB, context=bad)


def test_plan_of_the_48_layer_30b_file_keeps_a_default_kv_cache_under_half_a_gib(tmp_path) -> None:
    """The real header of Qwen3-30B-A3B Q8_0 (48 layers, context 40960) in a sparse file: defaults give
    4096 positions of f16 KV = 0.375 GiB (f32 at the model's context would be 7.5 GiB)."""
    path = write_sparse_qwen3moe(tmp_path / "q30b_48_header.gguf", layers=48)
    assert path.stat().st_size > 30 * GiB and os.stat(path).st_blocks * 512 < 64 * MiB
    r = run_cli("plan", str(path), "--ram-budget", "12G", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert (doc["context"], doc["kv_type"]) == (4096, "f16")
    assert doc["kv_cache"] == 2 * 48 * 4096 * 4 * 128 * 2 < GiB / 2
    table = run_cli("plan", str(path), "--ram-budget", "12G").stdout
    assert re.search(r"KV cache +0\.38 GiB f16 for 4096 positions \(default; the model allows 40960\)", table), table
    f32 = json.loads(run_cli("plan", str(path), "--ram-budget", "12G", "--kv-type", "f32", "--json").stdout)
    assert f32["kv_cache"] == 2 * doc["kv_cache"]


def test_kv_cache_allocates_what_the_plan_counts() -> None:
    from colibri_aio.arch.kvcache import KVCache

    for kv_type in ("f16", "f32"):
        cache = KVCache(48, 64, QWEN3_30B.args.kv_layout(), kv_type=kv_type)
        assert cache.nbytes == kv_cache_nbytes(SimpleNamespace(args=QWEN3_30B.args), 64, kv_type)
    with pytest.raises(UserError, match="--kv-type"):
        make_plan(QWEN3_30B, LIMITS, budget=12 * GiB, kv_type="q8")
