"""Fuzzed model files in the suite: seeded mutants of several fixtures through plan, doctor --verify, logits,
Engine.open and a chat prompt; each outcome is a clean result or one error line with exit 2, no case hangs,
and no case's memory grows past a bound. The same harness makes the long run (tools/fuzz_gguf.py)."""
from __future__ import annotations

import sys

import pytest

from support import FIXTURES

sys.path.insert(0, str(FIXTURES.parent / "tools"))
from gguf_fuzz.campaign import run_campaign  # noqa: E402
from gguf_fuzz.cases import classify_cli  # noqa: E402
from gguf_fuzz.layout import read_layout  # noqa: E402
from gguf_fuzz.mutate import IN_PLACE, RESIZING, mutate  # noqa: E402
from gguf_fuzz.summary import GROWTH_BOUND, Summary  # noqa: E402

FUZZED = [FIXTURES / name for name in (
    "colibri-tiny-q8_0.gguf", "tiny_q8_0.gguf", "tiny_q4_k.gguf", "tiny_f16.gguf", "quant_types/tiny_q5_0.gguf",
    "mixtral_q8_0.gguf", "gptoss_mxfp4.gguf")]
CASES = 300


@pytest.fixture(scope="module")
def campaign() -> Summary:
    summary = Summary()
    run_campaign(FUZZED, CASES, seed=20, timeout=60.0, kernels="numpy", render_seconds=1.0, report=summary.add)
    return summary


def test_every_outcome_is_clean_or_one_line(campaign: Summary) -> None:
    assert campaign.cases == CASES
    assert campaign.failures == [], campaign.failures[:5]
    assert campaign.hangs == campaign.crashes == campaign.tracebacks == campaign.over_memory == 0


def test_the_mutants_reach_every_stage(campaign: Summary) -> None:
    """Not all refused at the header: some pass every command, some are refused at each later stage."""
    reached = campaign.deepest
    assert reached["every action ok"] > 0
    assert reached["refused at plan"] > 0 and reached["refused at doctor"] > 0
    assert campaign.by_action["chat"]["ok"] > 0 and campaign.by_action["chat"]["refused"] > 0
    assert set(campaign.by_kind) == set(IN_PLACE) | set(RESIZING)


def test_refusals_name_the_file_and_memory_stays_bounded(campaign: Summary) -> None:
    assert campaign.refusals_naming_file >= 0.95 * campaign.refusals_total
    assert 0 < max(campaign.peak_growth) < GROWTH_BOUND


def test_mutants_are_reproducible_from_their_key() -> None:
    src = FIXTURES / "tiny_q8_0.gguf"
    raw, lay = src.read_bytes(), read_layout(src)
    a, b, c = (mutate(raw, lay, key) for key in ("tiny_q8_0.gguf/1-7", "tiny_q8_0.gguf/1-7", "tiny_q8_0.gguf/1-8"))
    assert a == b and a.data != c.data and a.data != raw


@pytest.mark.parametrize("status, err, cls", [
    (0, "", "ok"),
    (2, "colibri-aio: error: m.gguf: bad\n", "refused"),
    (2, "2026-12-01 [warning  ] a plan note\ncolibri-aio: error: m.gguf: bad\n", "refused"),
    (2, "colibri-aio: error: m.gguf: bad\nmore text\n", "not_one_line"),
    (2, "colibri-aio: error: a\ncolibri-aio: error: b\n", "not_one_line"),
    (2, "Traceback (most recent call last):\ncolibri-aio: error: x\n", "not_one_line"),
    (1, "colibri-aio: I/O error: m.gguf: reading 10 bytes at offset 5\n", "exit_1"),
])
def test_outcomes_are_classified_strictly(status: int, err: str, cls: str) -> None:
    assert classify_cli(status, err)[0] == cls


def test_an_action_past_the_timeout_is_a_hang_and_the_worker_is_replaced() -> None:
    summary = Summary()
    results = run_campaign([FIXTURES / "tiny_q8_0.gguf"], 2, seed=5, timeout=0.001, report=summary.add)
    assert summary.hangs == 2 and summary.failed == 2
    assert all(r.hang == "start" and r.kinds and r.failed for r in results)
