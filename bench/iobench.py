"""``iobench``: expert-sized reads through each I/O backend, side by side with fio on the same file.

For every block size (one expert's bytes), queue depth (experts in flight)
and backend it runs a closed loop of ``ExpertReader.start`` calls (one slot
per worker) for a fixed time and reports GB/s, IOPS and latency percentiles. When ``fio`` is on the
PATH each measurement is paired with a fio run (io_uring engine, same file,
block size, depth and O_DIRECT flag), the two run back to back in alternating
order, and the report gives the median of the per-pair our/fio ratios.

Each of an expert's three ranges is placed at its own random offset (a real
expert's gate, up and down live in three different tensors), so one of our
"reads" is three kernel reads totalling ``bs`` bytes; fio issues one read of
``bs``.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from colibri_aio.bench import devstat, receipt
from colibri_aio.cachefiles import cache_dir
from colibri_aio.bench.locations import split_expert
from colibri_aio.bench.lock import exclusive
from colibri_aio.errors import UserError
from colibri_aio.io.align import RANGES_PER_EXPERT
from colibri_aio.policy.budget import parse_size

# uring+reg: io_uring with registered (fixed) buffers; uring+async: every read issued by io_uring's kernel
# workers (IOSQE_ASYNC) instead of inline in io_uring_submit
BACKEND_CHOICES = ("uring", "uring+reg", "uring+async", "pread", "mmap")
FIO_RANDOM_SEED = 20260
REFILLS = ("expert", "range")  # how ours keeps the device's queue full (measure_ours); the first is the default
PAGES = ("huge", "4k")  # what the pool's memory is made of (BufferPool huge_pages)


# -- arguments ---------------------------------------------------------------

def positive_size(text: str) -> int:
    """A size as ``--ram-budget`` takes it (``4096``, ``64K``, ``1.5M``, ``4GiB``), refusing zero."""
    value = parse_size(text)
    if value <= 0:
        raise UserError(f"a size must be positive, got {text!r}")
    return value


def _csv(convert):
    def parse(text: str) -> list:
        items = [convert(t) for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError("empty list")
        return items
    return parse


def _one_of(choices: tuple[str, ...]):
    def parse(text: str) -> str:
        if text.strip() not in choices:
            raise argparse.ArgumentTypeError(f"unknown value {text!r} (choose from {', '.join(choices)})")
        return text.strip()
    return parse


def _backends(text: str) -> list[str]:
    names = list(BACKEND_CHOICES) if text == "all" else [t.strip() for t in text.split(",") if t.strip()]
    for name in names:
        if name not in BACKEND_CHOICES:
            raise argparse.ArgumentTypeError(f"unknown backend {name!r} (choose from {', '.join(BACKEND_CHOICES)}, all)")
    return names


def add_iobench_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``iobench`` subcommand's options."""
    parser.add_argument("file", nargs="?", type=Path, default=None,
                        help="file to read (default: a temporary test file in the model cache directory)")
    parser.add_argument("--bs", type=_csv(positive_size), default=[1 << 20, 4 << 20], metavar="SIZES",
                        help="expert sizes to read, comma-separated (default: 1M,4M)")
    parser.add_argument("--qd", type=_csv(int), default=[1, 8, 32], metavar="DEPTHS",
                        help="experts in flight, comma-separated (default: 1,8,32)")
    parser.add_argument("--backend", type=_backends, default=["uring"], metavar="NAMES",
                        help=f"comma-separated from {', '.join(BACKEND_CHOICES)}, or all (default: uring)")
    parser.add_argument("--refill", type=_csv(_one_of(REFILLS)), default=[REFILLS[0]], metavar="MODES",
                        help="how ours keeps the device's queue full: range (the ring admits QD experts' bytes and "
                             "refills as each range ends) or expert (each worker waits for its whole expert); "
                             "comma-separated for an interleaved A/B (default: expert)")
    parser.add_argument("--pages", type=_csv(_one_of(PAGES)), default=[PAGES[0]], metavar="KINDS",
                        help="the pool's pages: huge (transparent huge pages) or 4k; comma-separated for an "
                             "interleaved A/B. Every combination of --refill and --pages is an arm of ours; the "
                             "first of each is the 'ours' arm (default: huge)")
    parser.add_argument("--pattern", choices=("rand", "seq"), default="rand", help="offsets (default: %(default)s)")
    parser.add_argument("--runs", type=int, default=5, help="interleaved our/fio pairs per setting (default: %(default)s)")
    parser.add_argument("--seconds", type=float, default=2.0, help="length of each measurement (default: %(default)s)")
    parser.add_argument("--size", type=positive_size, default=4 << 30,
                        help="size of the temporary test file when no FILE is given (default: 4G)")
    parser.add_argument("--lock", type=Path, default=None, metavar="PATH",
                        help="hold an exclusive flock on PATH around each interleaved pair (a machine others share)")
    parser.add_argument("--no-fio", action="store_true", help="do not run fio even if it is installed")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    parser.add_argument("--receipt", type=Path, nargs="?", const=Path("evidence"), default=None, metavar="DIR",
                        help="also write iobench_<time>.json and .md into DIR (default DIR: evidence)")


# -- the test file -------------------------------------------------------------

def make_test_file(directory: Path, size: int) -> Path:
    """A file of ``size`` random bytes (real data: unwritten extents would read back without touching the disk)."""
    directory.mkdir(parents=True, exist_ok=True)
    if shutil.disk_usage(directory).free < size + (1 << 30):
        raise UserError(f"{directory}: not enough free space for a {size}-byte test file")
    fd, name = tempfile.mkstemp(prefix="iobench-", suffix=".bin", dir=directory)
    rng = np.random.default_rng(1)
    chunk = 64 << 20
    try:
        with os.fdopen(fd, "wb", buffering=0) as f:
            for start in range(0, size, chunk):
                f.write(rng.bytes(min(chunk, size - start)))
            os.fsync(f.fileno())
        drop_cached_pages(Path(name))
    except BaseException:
        os.unlink(name)
        raise
    return Path(name)


def drop_cached_pages(path: Path) -> None:
    """Evict this one file from the page cache (not the whole machine's: others share it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# -- one measurement of ours ---------------------------------------------------

RAMP_S = 0.1  # as fio's --ramp_time: reads that end before it are not counted


async def measure_ours(path: Path, backend: str, bs: int, qd: int, pattern: str, seconds: float,
                       seed: int, refill: str = "expert", pages: str = "huge") -> dict[str, Any]:
    """``qd`` workers each read one expert of ``bs`` bytes after another, measured as fio measures.

    ``refill`` says how the device's queue is kept full. ``expert``: each
    worker has one slot and waits for all three ranges of its expert before it
    starts the next, so the device's queue runs down while the slowest range
    of each expert is still out. ``range`` (io_uring only): each worker has
    two slots and hands its next expert to the reader before it waits for the
    current one, and the ring admits at most ``qd`` experts' bytes: the
    device holds the bytes of ``qd`` experts, as fio's queue holds ``qd``
    blocks of ``bs``, and a finished range's room goes to the next range at
    once, from the completion, without waiting for a worker to wake. That is
    how the engine reads (a layer's misses submitted together, the ring's
    byte bound keeping the rest in order). Latency is then counted from
    ``start``, time queued behind the byte bound included. ``expert`` is the
    default: with the pool in huge pages, ``range`` kept more bytes in flight
    but its gain was not consistent (range / expert over three receipts: 0.97,
    1.14, 1.24 at 1 MiB QD 8; 0.98-1.01 at 1 MiB QD 32; 0.83-1.11 at 4 MiB
    QD 8; 0.79-0.93 at 4 MiB QD 32; evidence/iobench_20261202T002636Z,
    ...T004056Z, ...T004937Z).

    The workers run without a pause from the first read to the last: after
    RAMP_S of ramp, the reads that end within the next ``seconds`` count, over
    exactly ``seconds``, so the queue is full the whole window, as fio's is
    (``--ramp_time``, ``--time_based``). ``gbps_whole`` counts every read over
    the whole run, ramp-up and final drain included (a stopped queue at both
    ends), which is how earlier versions measured ours. ``pages`` is the
    pool's memory: ``huge`` (transparent huge pages, the reader's default) or ``4k``.
    """
    from colibri_aio.bench.locations import bench_locations
    from colibri_aio.io import ExpertReader
    from colibri_aio.io.align import plan_expert

    if refill not in REFILLS:
        raise ValueError(f"unknown refill {refill!r}")
    kind = backend.split("+")[0]
    if kind != "uring":
        refill = "expert"  # only the ring bounds the bytes in flight
    # Workers share one list and one cursor: with ``seq`` the disk sees one stream in order.
    locations = bench_locations(path.stat().st_size, bs, 4096, pattern, np.random.default_rng(seed))
    bound = {"max_inflight_bytes": qd * plan_expert(locations[0]).read_nbytes} if refill == "range" else {}
    reader = await ExpertReader.open(path, bs, n_slots=2 * qd if refill == "range" else qd, backend=kind,
                                     register=backend.endswith("+reg"), punt=backend.endswith("+async"),
                                     huge_pages=pages == "huge", **bound)
    reads: list[tuple[float, float]] = []  # (start, end) of every read
    stop_at = 0.0
    cursor = itertools.count()

    def begin(slot: int) -> tuple[float, asyncio.Future] | None:
        now = time.perf_counter()
        if now >= stop_at:
            return None
        return now, reader.start(locations[next(cursor) % len(locations)], slot)

    async def worker(slot: int) -> None:  # each worker reads into its own slot
        while (current := begin(slot)) is not None:
            await current[1]
            reads.append((current[0], time.perf_counter()))

    async def double_buffered(slot: int) -> None:  # slots ``slot`` and ``slot + qd``: the next read is queued
        slots = (slot, slot + qd)
        current = begin(slots[0])
        turn = 1
        while current is not None:
            upcoming = begin(slots[turn])
            await current[1]
            reads.append((current[0], time.perf_counter()))
            current, turn = upcoming, 1 - turn

    work = double_buffered if refill == "range" else worker
    try:
        start = time.perf_counter()
        t0 = start + RAMP_S
        stop_at = t0 + seconds
        cpu0 = time.process_time()
        await asyncio.gather(*(work(slot) for slot in range(qd)))
        end, cpu = time.perf_counter(), time.process_time() - cpu0
        info = {"backend": reader.backend, "reason": reader.backend_reason, "refill": refill,
                "huge_pages": reader.pool.huge_pages if reader.pool is not None else False,
                "registered": reader.registered, "o_direct": reader.direct}
    finally:
        await reader.aclose()
    window = [e - s for s, e in reads if t0 <= e < stop_at]
    n = len(window)
    lat = np.array(window) if window else np.zeros(1)
    return {"reads": n, "seconds": seconds, "gbps": n * bs / seconds / 1e9, "iops": n / seconds,
            "gbps_whole": len(reads) * bs / (end - start) / 1e9,
            "lat_p50_ms": float(np.percentile(lat, 50) * 1e3), "lat_p99_ms": float(np.percentile(lat, 99) * 1e3),
            "cpu_us_per_read": cpu / max(len(reads), 1) * 1e6, **info}


# -- one measurement of fio ----------------------------------------------------

def fio_command(path: Path, bs: int, qd: int, pattern: str, seconds: float, direct: bool, seed: int,
                mem: str = "malloc") -> list[str]:
    return ["fio", f"--mem={mem}", "--name=iobench", f"--filename={path}", "--ioengine=io_uring", f"--direct={int(direct)}",
            f"--rw={'randread' if pattern == 'rand' else 'read'}", f"--bs={bs}", f"--iodepth={qd}",
            "--numjobs=1", "--time_based", f"--runtime={round(seconds * 1000)}ms", "--ramp_time=100ms",
            "--norandommap", f"--randseed={FIO_RANDOM_SEED + seed}", "--lat_percentiles=1",
            "--output-format=json"]


def measure_fio(path: Path, bs: int, qd: int, pattern: str, seconds: float, direct: bool,
                seed: int, mem: str = "malloc") -> dict[str, Any]:
    """Run fio once and return the same figures as :func:`measure_ours`."""
    cmd = fio_command(path, bs, qd, pattern, seconds, direct, seed, mem)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 120)
    if done.returncode != 0:
        raise RuntimeError(f"fio failed ({done.returncode}): {done.stderr.strip()[:500]}")
    job = json.loads(done.stdout[done.stdout.index("{"):])["jobs"][0]
    read = job["read"]
    pct = read.get("lat_ns", {}).get("percentile") or read.get("clat_ns", {}).get("percentile", {})
    reads = read["total_ios"]
    runtime_s = read["runtime"] / 1e3
    cpu_s = (job["usr_cpu"] + job["sys_cpu"]) / 100 * runtime_s  # fio's own accounting, start-up excluded
    return {"reads": reads, "seconds": runtime_s, "gbps": read["bw_bytes"] / 1e9, "iops": read["iops"],
            "lat_p50_ms": pct.get("50.000000", 0) / 1e6, "lat_p99_ms": pct.get("99.000000", 0) / 1e6,
            "cpu_us_per_read": cpu_s / max(reads, 1) * 1e6, "bs": bs, "qd": qd, "command": " ".join(cmd)}


# -- the whole run -------------------------------------------------------------

FIGURES = ("gbps", "iops", "lat_p50_ms", "lat_p99_ms", "cpu_us_per_read")
DEVICE_FIGURES = ("request_kib", "depth_busy", "inflight_mib", "utilisation")  # what the block device saw


FIO_ARMS = ("fio", "fio_split", "fio_huge", "fio_split_huge")


def ours_arms(args: argparse.Namespace) -> dict[str, tuple[str, str]]:
    """Arm name -> (refill, pages) for every combination asked for; the first is ``ours``, the others
    ``ours_<refill>_<pages>``."""
    combos = [(r, p) for r in getattr(args, "refill", None) or REFILLS[:1]
              for p in getattr(args, "pages", None) or PAGES[:1]]
    return {("ours" if i == 0 else f"ours_{r}_{p}"): (r, p) for i, (r, p) in enumerate(dict.fromkeys(combos))}


def arm_names(pair: dict[str, Any]) -> list[str]:
    """The arms of a pair in a stable order: ours, ours' other variants, fio's."""
    return sorted(pair, key=lambda a: (a != "ours", a in FIO_ARMS, a))


def fio_arms(bs: int, qd: int, huge_free: int = 0) -> dict[str, tuple[int, int, str]]:
    """fio's (block size, depth, buffer memory) per arm: the same as ours; split like our kernel reads; and, when
    ``huge_free`` bytes of reserved huge pages hold its buffers, both again into huge pages, as our pool is."""
    part = split_expert(bs)[0]
    arms = {"fio": (bs, qd, "malloc"), "fio_split": (part, RANGES_PER_EXPERT * qd, "malloc")}
    if huge_free >= qd * bs + (4 << 20):  # fio's buffers plus its alignment slack
        arms["fio_huge"] = (bs, qd, "mmaphuge")
    if huge_free >= RANGES_PER_EXPERT * qd * part + (4 << 20):
        arms["fio_split_huge"] = (part, RANGES_PER_EXPERT * qd, "mmaphuge")
    return arms


def hugetlb_free_bytes() -> int:
    """Bytes of free reserved huge pages (``/proc/sys/vm/nr_hugepages``), what ``fio --mem=mmaphuge`` needs."""
    from colibri_aio.engine.memory import meminfo  # here: colibri_aio.engine imports the whole engine

    try:
        info = meminfo()
    except OSError:
        return 0
    return info.get("HugePages_Free", 0) * info.get("Hugepagesize", 0)


async def measure_pair(path: Path, args: argparse.Namespace, backend: str, bs: int, qd: int, run: int,
                       use_fio: bool) -> dict[str, dict[str, Any]]:
    """Ours and fio's arms back to back, starting with a different arm on each run."""
    direct = backend != "mmap"
    variants = ours_arms(args)
    references = fio_arms(bs, qd, hugetlb_free_bytes()) if use_fio else {}
    arms = [*variants, *references]
    shift = run % len(arms)
    arms = arms[shift:] + arms[:shift]  # rotate who goes first so drift favours no arm
    pair: dict[str, dict[str, Any]] = {}
    disk = devstat.disk_of(path)
    for arm in arms:
        if not direct:
            drop_cached_pages(path)  # every buffered arm starts from a cold page cache
        before = devstat.snapshot(disk) if disk is not None else None
        if arm in variants:
            refill, pages = variants[arm]
            pair[arm] = await measure_ours(path, backend, bs, qd, args.pattern, args.seconds, seed=run,
                                           refill=refill, pages=pages)
        else:
            fio_bs, fio_qd, mem = references[arm]
            pair[arm] = await asyncio.to_thread(measure_fio, path, fio_bs, fio_qd, args.pattern, args.seconds,
                                                direct, run, mem)
        if before is not None:
            pair[arm]["device"] = devstat.between(before, devstat.snapshot(disk))
    return pair


async def bench(path: Path, args: argparse.Namespace, use_fio: bool, progress) -> list[dict[str, Any]]:
    """Every (backend, bs, qd) setting, ``args.runs`` interleaved rounds of all arms each."""
    settings = [(b, bs, qd) for b in args.backend for bs in args.bs for qd in args.qd]
    samples: dict[tuple[str, int, int], list[dict[str, dict[str, Any]]]] = {s: [] for s in settings}
    for run in range(args.runs):
        for backend, bs, qd in settings:
            with exclusive(getattr(args, "lock", None)):
                pair = await measure_pair(path, args, backend, bs, qd, run, use_fio)
            samples[(backend, bs, qd)].append(pair)
            progress(run, backend, bs, qd, pair)
    return [summarise(backend, bs, qd, args.pattern, pairs) for (backend, bs, qd), pairs in samples.items()]


def summarise(backend: str, bs: int, qd: int, pattern: str, pairs: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Medians and ranges of every arm, and of the per-pair our/fio ratios."""
    ours = [p["ours"] for p in pairs]
    row: dict[str, Any] = {"backend": backend, "bs": bs, "qd": qd, "pattern": pattern,
                           "ours_backend": ours[0]["backend"], "ours_reason": ours[0]["reason"],
                           "refill": ours[0]["refill"], "huge_pages": ours[0]["huge_pages"],
                           "ours": {k: receipt.spread([s[k] for s in ours]) for k in FIGURES}, "ours_samples": ours}
    for arm in (a for a in arm_names(pairs[0]) if all("device" in p[a] for p in pairs)):
        row[f"{arm}_device"] = {k: receipt.spread([p[arm]["device"][k] for p in pairs]) for k in DEVICE_FIGURES}
    for arm in (a for a in arm_names(pairs[0]) if a.startswith("ours_")):  # another variant of ours
        row[arm] = {k: receipt.spread([p[arm][k] for p in pairs]) for k in FIGURES}
        row[f"{arm}_samples"] = [p[arm] for p in pairs]
        row[f"{arm}_vs_ours"] = receipt.spread([p[arm]["gbps"] / p["ours"]["gbps"] for p in pairs])
        for ref in (a for a in ("fio", "fio_huge") if all(a in p for p in pairs)):
            row[f"{arm}_{ref}_ratio"] = receipt.spread([p[arm]["gbps"] / p[ref]["gbps"] for p in pairs])
    for arm in (a for a in FIO_ARMS if a in pairs[0] and all(a in p for p in pairs)):
        runs = [p[arm] for p in pairs]
        ratios = [p["ours"]["gbps"] / p[arm]["gbps"] for p in pairs]
        row[arm] = {k: receipt.spread([s[k] for s in runs]) for k in FIGURES}
        row[f"{arm}_samples"] = runs
        row[f"{arm}_ratio"] = receipt.spread(ratios)
        row[f"{arm}_ratio_samples"] = ratios
        if arm == "fio" and all("gbps_whole" in o for o in ours):
            row["fio_ratio_whole"] = receipt.spread([p["ours"]["gbps_whole"] / p[arm]["gbps"] for p in pairs])
    return row


def _fmt(s: dict[str, float], digits: int = 2) -> str:
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def render_table(rows: list[dict[str, Any]]) -> str:
    """One line per setting: medians with [min-max]; ratios are medians of per-pair ratios."""
    lines = ["| backend | bs | QD | ours GB/s | IOPS | p50 ms | p99 ms | CPU us/read "
             "| fio GB/s | ours/fio | fio split GB/s | ours/fio split | fio huge GB/s | ours/fio huge "
             "| fio split huge GB/s | ours/fio split huge |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    whole = []
    for r in rows:
        o = r["ours"]
        cells = [r["backend"], f"{r['bs'] >> 10} KiB", str(r["qd"]), _fmt(o["gbps"]),
                 f"{o['iops']['median']:.0f}", _fmt(o["lat_p50_ms"]), _fmt(o["lat_p99_ms"]),
                 f"{o['cpu_us_per_read']['median']:.0f}"]
        for arm in FIO_ARMS:
            cells += [_fmt(r[arm]["gbps"]), _fmt(r[f"{arm}_ratio"], 3)] if arm in r else ["-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
        for arm in (a for a in r if a.startswith("ours_") and f"{a}_vs_ours" in r):
            whole.append(f"- {r['backend']} {r['bs'] >> 10} KiB QD {r['qd']}: {arm} {_fmt(r[arm]['gbps'])} GB/s, "
                         f"{arm}/ours ({r['refill']}, {'huge' if r['huge_pages'] else '4k'} pages) "
                         f"{_fmt(r[f'{arm}_vs_ours'], 3)}"
                         + "".join(f", {arm}/{ref} {_fmt(r[f'{arm}_{ref}_ratio'], 3)}" for ref in ("fio", "fio_huge")
                                   if f"{arm}_{ref}_ratio" in r))
        if "fio_ratio_whole" in r:
            whole.append(f"- {r['backend']} {r['bs'] >> 10} KiB QD {r['qd']}: ours/fio "
                         f"{_fmt(r['fio_ratio_whole'], 3)} counting ours over its whole run, ramp-up and drain "
                         f"included (the window above counts as fio does)")
    return "\n".join(lines + ([""] + whole if whole else []))


def render_device_table(rows: list[dict[str, Any]]) -> str:
    """What the block device saw per arm: request size, queue depth while busy, bytes in flight (medians)."""
    lines = ["| backend | bs | QD | arm | request KiB | device queue depth | in flight MiB | utilisation |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for arm in (a for a in [k[:-len("_device")] for k in r if k.endswith("_device")]):
            d = r[f"{arm}_device"]
            lines.append(f"| {r['backend']} | {r['bs'] >> 10} KiB | {r['qd']} | {arm} | {_fmt(d['request_kib'], 0)} "
                         f"| {_fmt(d['depth_busy'], 1)} | {_fmt(d['inflight_mib'], 1)} "
                         f"| {_fmt(d['utilisation'], 2)} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def write_receipt(directory: Path, document: dict[str, Any]) -> tuple[Path, Path]:
    """``iobench_<time>.json`` (every sample) and ``.md`` (the table) in ``directory``."""
    name = f"iobench_{receipt.stamp()}"
    h = document["host"]
    md = [f"# {name.replace('_', ' ')}", "",
          f"- command: `{document['command']}`",
          f"- commit: `{document['commit']}`",
          f"- host: {h['hostname']}, Linux {h['kernel']}, {h['cpus']} CPUs, {h['mem_bytes'] / 2**30:.1f} GiB RAM; "
          f"load average at start {document['loadavg_start']}, at end {document['loadavg_end']}",
          f"- CPU: {h.get('cpu_described', h.get('cpu', '?'))}",
          f"- file: {document['file']} ({document['file_bytes']} bytes{', temporary' if document['temporary_file'] else ''})",
          f"- pattern: {document['pattern']}; {document['runs']} interleaved our/fio pairs of "
          f"{document['seconds']} s each per setting; medians with [min-max]",
          f"- event loop: {document['event_loop']}",
          f"- {document['note']}", "", render_table(document["results"]), ""]
    device = render_device_table(document["results"])
    if device:
        md += [f"What the block device saw in each arm (/sys/block stat, whole device; queue limits "
               f"{document.get('disk_queue')}):", "", device, ""]
    for r in document["results"]:
        md.append(f"- {r['backend']} {r['bs'] >> 10} KiB QD {r['qd']}: {r['ours_reason']}")
    return receipt.write(directory, name, document, "\n".join(md) + "\n")


def git_commit() -> str:
    """HEAD, with ``+dirty`` when the I/O layer or this benchmark has uncommitted changes."""
    state = receipt.git_state("io", "bench/iobench.py")
    return state["sha"] + ("+dirty" if state["modified"] else "")


def run_iobench(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args``; print a table (or JSON); return the exit status."""
    # One line per reader opening would drown the table: keep only warnings, on stderr.
    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
                        logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    try:
        return _run_iobench(args)
    finally:
        structlog.configure(**saved)


def _run_iobench(args: argparse.Namespace) -> int:
    if args.runs < 1 or args.seconds <= 0:
        raise UserError("--runs must be >= 1 and --seconds > 0")
    use_fio = not args.no_fio and shutil.which("fio") is not None
    temporary = args.file is None
    path = make_test_file(cache_dir(), args.size) if temporary else args.file
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    load_start = os.getloadavg()
    commit = git_commit()  # before the run: the code measured is the code at start

    def progress(run: int, backend: str, bs: int, qd: int, pair: dict[str, Any]) -> None:
        ours = pair["ours"]
        text = f"run {run + 1}/{args.runs} {backend} bs={bs >> 10}K qd={qd}: ours {ours['gbps']:.2f} GB/s"
        for arm in arm_names(pair)[1:]:
            if arm in pair:
                text += f", {arm} {pair[arm]['gbps']:.2f} GB/s (ratio {ours['gbps'] / pair[arm]['gbps']:.3f})"
        print(text, file=sys.stderr, flush=True)

    try:
        loop_name = "asyncio"
        try:
            import uvloop
            runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
            loop_name = f"uvloop {uvloop.__version__}"
        except ImportError:
            runner = asyncio.Runner()
        with runner:
            rows = runner.run(bench(path, args, use_fio, progress))
        document = {
            "command": " ".join(sys.orig_argv),
            "commit": commit, "host": receipt.host_facts(), "when_utc": datetime.datetime.now(
                datetime.timezone.utc).isoformat(timespec="seconds"),
            "file": str(path), "file_bytes": path.stat().st_size, "temporary_file": temporary,
            "disk_queue": devstat.queue_limits(disk) if (disk := devstat.disk_of(path)) is not None else None,
            "pattern": args.pattern, "runs": args.runs, "seconds": args.seconds, "event_loop": loop_name,
            "fio": (subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip()
                    if use_fio else None),
            "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
            "note": "shared machine: other engineers' jobs (builds, training, tests) ran during this benchmark",
            "results": rows,
        }
    finally:
        if temporary:
            path.unlink(missing_ok=True)
    if args.receipt is not None:
        json_path, md_path = write_receipt(args.receipt, document)
        print(f"receipt: {json_path} {md_path}", file=sys.stderr)
    if args.json:
        print(json.dumps(document, indent=1))
    else:
        print(render_table(rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m colibri_aio.bench.iobench", description=__doc__.splitlines()[0])
    add_iobench_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_iobench(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
