"""The Python API (async and plain), telemetry and doctor, as users meet them."""
from __future__ import annotations

import asyncio
import json

import pytest

import colibri_aio
from colibri_aio import Engine, EngineStats, GenerationPiece

from support import fixture, run_cli

MODEL = fixture("tiny_q8_0.gguf")


async def test_async_stream_carries_text_timing_and_stats() -> None:
    async with await Engine.open(MODEL, cache_per_layer=3, io="pread") as engine:
        pieces = [p async for p in engine.generate("The list type", max_tokens=6, temperature=0.7, seed=3)]
    assert [p.finish_reason for p in pieces] == [None] * 5 + ["length"]
    assert all(isinstance(p, GenerationPiece) and isinstance(p.stats, EngineStats) for p in pieces)
    last = pieces[-1]
    assert last.generated_tokens == 6 and last.prompt_tokens == len(engine.prompt_ids("The list type"))
    assert last.stats.generated_tokens == 6 and last.stats.lookups > 0
    assert last.stats.decode_s > 0 and last.decode_tps > 0 and last.stats.peak_rss >= last.stats.rss > 0
    assert "".join(p.text for p in pieces) == engine.tokenizer.decode([p.token for p in pieces], skip_special=True)


async def test_chat_messages_and_stop_strings() -> None:
    async with await Engine.open(MODEL) as engine:
        text = "".join([p.text async for p in engine.generate([{"role": "user", "content": "hi"}], max_tokens=8)])
        full = "".join([p.text async for p in engine.generate("The list type", max_tokens=12)])
        stop = full[len(full) // 2: len(full) // 2 + 2]
        cut = [p async for p in engine.generate("The list type", max_tokens=12, stop=[stop])]
    assert isinstance(text, str)
    assert cut[-1].finish_reason == "stop" and "".join(p.text for p in cut) == full[: full.index(stop)]


def test_plain_iterator_and_early_break_closes_cleanly() -> None:
    got = []
    for piece in colibri_aio.generate("The list type", model=MODEL, max_tokens=20, placement={"io": "uring"}):
        got.append(piece.token)
        if len(got) == 3:
            break
    assert len(got) == 3
    again = [p.token for p in colibri_aio.generate("The list type", model=MODEL, max_tokens=3)]
    assert again == got  # greedy: the same three tokens, from a fresh engine


async def test_cancelling_the_consumer_task_stops_generation() -> None:
    async with await Engine.open(MODEL, io="uring", cache_per_layer=2) as engine:
        seen = 0

        async def consume() -> None:
            nonlocal seen
            async for _ in engine.generate("The list type", max_tokens=500):
                seen += 1

        task = asyncio.create_task(consume())
        while seen < 3:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert engine.source.reader.in_flight == 0 and seen < 500


def test_run_writes_stats_json_lines(tmp_path) -> None:
    out = tmp_path / "stats.jsonl"
    r = run_cli("run", "--model", str(MODEL), "--max-tokens", "60", "--stats", "--stats-interval", "0.02",
                "--stats-json", str(out), "--cache-per-layer", "2", "--io", "uring")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows, "no samples"
    for row in rows:
        for key in ("r/s", "rMB/s", "rareq-sz", "r_await", "aqu-sz", "%util", "tok/s", "hit%", "pin%", "lru%",
                    "pre%", "miss/s", "pf", "pf-prec%", "wasteMB", "infl", "slots", "RSS_MB", "engine"):
            assert key in row
        assert 0 <= row["hit%"] <= 100.0001 and row["tok/s"] >= 0 and row["RSS_MB"] > 10
    assert sum(r["engine"]["generated_tokens"] for r in rows[-1:]) == 60
    assert "tok/s" in r.stderr and "expert hit" in r.stderr.splitlines()[-1]


def test_doctor_reports_a_verdict_per_check() -> None:
    r = run_cli("doctor", str(MODEL))
    assert r.returncode == 0, r.stdout + r.stderr
    names = [line.split()[1] for line in r.stdout.splitlines()]
    assert names == ["cpu", "probe", "probe", "memory", "memlock", "gguf", "kernels", "o_direct", "io", "read"]
    assert all(line.split()[0] in ("OK", "WARN") for line in r.stdout.splitlines())
    bad = run_cli("doctor", str(fixture("truncated_bad.gguf")))
    assert bad.returncode == 2 and "FAIL  gguf" in bad.stdout


async def test_progress_hears_each_long_step(tmp_path) -> None:
    steps: list[tuple[str, int, int]] = []
    async with await Engine.open(MODEL, io="pread", cache_per_layer=4) as engine:
        [p async for p in engine.generate("The list type", max_tokens=4)]
    async with await Engine.open(MODEL, io="pread", cache_per_layer=4, pin="auto",
                                 progress=lambda *a: steps.append(a)):
        pass
    # The steps run side by side: each one's reports are in order, the steps' are interleaved.
    for name in ("load trunk", "allocate pool", "load kernels"):
        mine = [s for s in steps if s[0] == name]
        assert mine and mine[-1][1] == mine[-1][2] > 0, name
        assert [s[1] for s in mine] == sorted(s[1] for s in mine), name
    pins = [s for s in steps if s[0] == "pin experts"]
    assert pins and pins[-1][1] == pins[-1][2] > 0


def test_telemetry_read_rate_agrees_with_the_device(tmp_path) -> None:
    """Our own read counters and /proc/diskstats see the same bytes (O_DIRECT: no page cache in between).

    Tolerance: the device must show at least 90% of what we asked for, and at
    most 50% more plus 16 MB (file-system metadata and whatever else reads
    the disk meanwhile; CI runs alone on its machine).
    """
    import time

    from colibri_aio.engine.device import DeviceMonitor, between

    model = fixture("colibri-tiny-q8_0.gguf")
    monitor = DeviceMonitor.for_path(model)
    if monitor is None:
        pytest.skip("the model's file system names no block device (overlay, tmpfs): no diskstats to compare")
    before = monitor.read()
    time.sleep(1.0)
    idle = between(before, monitor.read())
    if idle is not None and idle.read_bps > 2e6:
        pytest.skip(f"{monitor.device} is busy with other readers ({idle.read_bps / 1e6:.0f} MB/s): "
                    "nothing to compare")
    out = tmp_path / "stats.jsonl"
    r = run_cli("run", "--model", str(model), "--max-tokens", "64", "--stats-json", str(out), "--stats-interval",
                "0.05", "--cache-per-layer", "4", "--io", "uring", "--prefetch", "off")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    ours = sum(row["ourMB/s"] * row["seconds"] for row in rows)
    device = sum(row["rMB/s"] * row["seconds"] for row in rows)
    assert ours > 5, f"too little was read to compare ({ours:.1f} MB)"
    assert 0.9 * ours <= device <= 1.5 * ours + 16, (ours, device)
