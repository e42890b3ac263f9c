"""iobench on a tiny file: the options parse, every backend is measured, fio is paired when present."""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from colibri_aio.errors import UserError
from colibri_aio.bench.iobench import add_iobench_arguments, positive_size, run_iobench, write_receipt
from support import requires_uring

pytestmark = requires_uring


def test_sizes_parse_as_ram_budgets_do_but_must_be_positive() -> None:
    assert [positive_size(t) for t in ("4096", "64K", "1M", "1.5M", "4G", "4GiB")] == [
        4096, 64 << 10, 1 << 20, 3 << 19, 4 << 30, 4 << 30]
    for bad in ("", "M", "-1M", "lots", "0", "0K"):
        with pytest.raises(UserError):
            positive_size(bad)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_iobench_arguments(parser)
    return parser.parse_args(argv)


def test_defaults_follow_the_issue() -> None:
    args = parse([])
    assert (args.file, args.bs, args.qd, args.backend, args.pattern) == (None, [1 << 20, 4 << 20], [1, 8, 32],
                                                                        ["uring"], "rand")
    assert parse(["--backend", "all"]).backend == ["uring", "uring+reg", "uring+async", "pread", "mmap"]
    with pytest.raises(SystemExit):
        parse(["--backend", "aio"])


@pytest.fixture(scope="module")
def small_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("iobench") / "data.bin"
    path.write_bytes(np.random.default_rng(2).bytes(16 << 20))
    return path


def test_every_backend_is_measured(small_file: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    args = parse([str(small_file), "--bs", "64K", "--qd", "1,4", "--backend", "all",
                  "--runs", "1", "--seconds", "0.2", "--no-fio", "--json", "--receipt", str(tmp_path)])
    assert run_iobench(args) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {(r["backend"], r["qd"]): r for r in doc["results"]}
    assert set(rows) == {(b, q) for b in ("uring", "uring+reg", "uring+async", "pread", "mmap") for q in (1, 4)}
    assert [rows[(b, 1)]["ours_samples"][0]["registered"] for b in ("uring", "uring+reg")] == [False, True]
    for row in rows.values():
        # Counted over the whole run: on a loaded machine a 0.2 s window can hold no completion at all, and how
        # fast the reads are is the benchmark's business, not this test's (it checks that each backend ran).
        sample = row["ours_samples"][0]
        assert sample["gbps_whole"] > 0 and "fio" not in row
    assert doc["file"] == str(small_file) and doc["temporary_file"] is False
    assert doc["commit"] and doc["host"]["cpus"] and "shared machine" in doc["note"]
    receipts = sorted(tmp_path.glob("iobench_*"))
    assert [p.suffix for p in receipts] == [".json", ".md"]
    assert json.loads(receipts[0].read_text())["results"] == doc["results"]


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")
def test_fio_is_paired_on_the_same_file(small_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = parse([str(small_file), "--bs", "64K", "--qd", "2", "--runs", "2", "--seconds", "0.2", "--json"])
    assert run_iobench(args) == 0
    row = json.loads(capsys.readouterr().out)["results"][0]
    for arm, (bs, qd) in {"fio": (64 << 10, 2), "fio_split": (20480, 6)}.items():
        assert len(row[f"{arm}_samples"]) == 2 and len(row[f"{arm}_ratio_samples"]) == 2
        sample = row[f"{arm}_samples"][0]
        assert (sample["bs"], sample["qd"]) == (bs, qd) and sample["gbps"] > 0 and sample["lat_p99_ms"] > 0
        assert f"--filename={small_file}" in sample["command"] and "--direct=1" in sample["command"]
        ratio = row[f"{arm}_ratio"]["median"]
        assert ratio == pytest.approx(np.median([o["gbps"] / f["gbps"] for o, f in
                                                 zip(row["ours_samples"], row[f"{arm}_samples"])]))


def test_sequential_pattern_is_measured(small_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = parse([str(small_file), "--bs", "64K", "--qd", "4", "--pattern", "seq", "--runs", "1",
                  "--seconds", "0.2", "--no-fio", "--json"])
    assert run_iobench(args) == 0
    row = json.loads(capsys.readouterr().out)["results"][0]
    assert row["pattern"] == "seq" and row["ours_samples"][0]["gbps_whole"] > 0  # whole run: see above


def test_missing_file_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no such file"):
        run_iobench(parse([str(tmp_path / "missing.bin"), "--no-fio"]))


def test_receipt_summary_names_host_commit_and_command(tmp_path: Path) -> None:
    doc = {"command": "python -m colibri_aio iobench", "commit": "abc", "when_utc": "now",
           "host": {"hostname": "h", "kernel": "k", "cpus": 2, "mem_bytes": 1 << 30},
           "loadavg_start": (1, 1, 1), "loadavg_end": (2, 2, 2), "file": "f", "file_bytes": 1,
           "temporary_file": True, "pattern": "rand", "runs": 5, "seconds": 2.0, "event_loop": "uvloop",
           "note": "shared machine", "results": []}
    _json_path, md_path = write_receipt(tmp_path, doc)
    md = md_path.read_text()
    assert "`python -m colibri_aio iobench`" in md and "`abc`" in md and "shared machine" in md


def test_every_refill_and_pages_combination_is_an_arm_of_ours(small_file: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    args = parse([str(small_file), "--bs", "64K", "--qd", "2", "--backend", "uring,pread", "--refill", "range,expert",
                  "--pages", "huge,4k", "--runs", "1", "--seconds", "0.2", "--no-fio", "--json"])
    assert run_iobench(args) == 0
    rows = {r["backend"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    uring = rows["uring"]
    assert (uring["refill"], uring["ours_samples"][0]["refill"]) == ("range", "range")
    for arm, (refill, huge) in {"ours_range_4k": ("range", False), "ours_expert_huge": ("expert", True),
                                "ours_expert_4k": ("expert", False)}.items():
        sample = uring[f"{arm}_samples"][0]
        assert sample["refill"] == refill and sample["reads"] > 0
        assert sample["huge_pages"] is (huge and uring["huge_pages"])
        assert uring[f"{arm}_vs_ours"]["median"] == pytest.approx(sample["gbps"] / uring["ours_samples"][0]["gbps"])
    # Only the ring bounds the bytes in flight: other backends wait for each expert whatever was asked.
    assert rows["pread"]["ours_samples"][0]["refill"] == "expert"


def test_device_figures_are_what_iostat_would_say() -> None:
    from colibri_aio.bench.devstat import DiskCounters, between

    before = DiskCounters(when=10.0, reads=100, merges=0, sectors=0, read_ms=0, busy_ms=0, queue_ms=0, writes=0)
    # 2 s, 400 requests of 256 KiB, the device busy 1.5 s with 12 requests in flight on average while busy
    after = DiskCounters(when=12.0, reads=500, merges=3, sectors=400 * 512, read_ms=4000, busy_ms=1500,
                         queue_ms=18000, writes=1)
    got = between(before, after)
    assert got["requests"] == 400 and got["request_kib"] == 256 and got["request_ms"] == 10
    assert got["utilisation"] == 0.75 and got["queue_depth"] == 9 and got["depth_busy"] == 12
    assert got["inflight_mib"] == 3 and got["gbps"] == pytest.approx(400 * 256 * 1024 / 2 / 1e9)


def test_fio_reads_into_huge_pages_only_when_enough_are_reserved() -> None:
    from colibri_aio.bench.iobench import fio_arms

    assert set(fio_arms(1 << 20, 8, huge_free=0)) == {"fio", "fio_split"}
    assert fio_arms(1 << 20, 8, huge_free=8 << 20)["fio_split"] == (348160, 24, "malloc")
    assert fio_arms(1 << 20, 8, huge_free=64 << 20)["fio_huge"] == (1 << 20, 8, "mmaphuge")
    assert fio_arms(1 << 20, 8, huge_free=64 << 20)["fio_split_huge"] == (348160, 24, "mmaphuge")
