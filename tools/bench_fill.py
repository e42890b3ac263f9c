"""CPU and wall time to bring a model file's bytes into memory: the page cache against a pool filled by O_DIRECT.

Two ways the engine can hold experts that all fit, measured on the same byte range of one file, interleaved,
the page cache dropped before each sample:

- page-cache: one ``posix_fadvise(WILLNEED)`` over the range, then ``MADV_POPULATE_READ`` of a read-only
  mapping (what the mmap reader does), so the bytes stay in the page cache;
- o-direct: 8 worker threads ``preadv`` 8 MiB pieces with O_DIRECT into fresh anonymous memory (huge pages
  asked), as the pool is filled: every page is faulted in and zeroed by the CPU on first touch.

Per sample: wall seconds, GiB/s and the process's CPU seconds (user + system, every thread). The reference is the
other arm of the same round.

    python tools/bench_fill.py --model MODEL [--gib 4] [--runs 5] [--lock /work/cpu.lock]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import mmap
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from colibri_aio.bench.lock import exclusive  # noqa: E402
from colibri_aio.bench.pagecache import drop_page_cache  # noqa: E402
from colibri_aio.bench.receipt import header, markdown_head, spread, write  # noqa: E402
from colibri_aio.io.backends import MADV_POPULATE_READ  # noqa: E402
from colibri_aio.io.madvise import address_of, madvise  # noqa: E402

CHUNK = 8 << 20
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)


def fill_page_cache(path: Path, offset: int, nbytes: int, through_libc: bool = False) -> None:
    """The bytes into the page cache, populated into a mapping by ``mmap.madvise`` (which holds the GIL for the
    whole call) or, ``through_libc``, by io.madvise (which releases it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        mapped = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ, offset=offset)
        os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_WILLNEED)
        if through_libc:
            madvise(address_of(mapped), nbytes, MADV_POPULATE_READ)
        else:
            mapped.madvise(MADV_POPULATE_READ, 0, nbytes)
        mapped.close()
    finally:
        os.close(fd)


def fill_o_direct(path: Path, offset: int, nbytes: int) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(MADV_HUGEPAGE)
        view = memoryview(buf)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda at: os.preadv(fd, [view[at:at + CHUNK]], offset + at), range(0, nbytes, CHUNK)))
        view.release()
    finally:
        buf.close()
        os.close(fd)


ARMS = {"page-cache": fill_page_cache, "o-direct": fill_o_direct}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--gib", type=int, default=4, help="bytes to bring in, from 1 GiB into the file")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--lock", type=Path)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "evidence")
    args = p.parse_args()
    offset, nbytes = 1 << 30, args.gib << 30
    if args.model.stat().st_size < offset + nbytes:
        print(f"bench_fill: {args.model} is smaller than {offset + nbytes} bytes", file=sys.stderr)
        return 2
    samples = []
    for r in range(args.runs):
        for arm in (list(ARMS) if r % 2 == 0 else list(ARMS)[::-1]):
            with exclusive(args.lock):
                dropped = drop_page_cache()
                t0, c0 = time.perf_counter(), os.times()
                ARMS[arm](args.model, offset, nbytes)
                wall, c1 = time.perf_counter() - t0, os.times()
            cpu = (c1.user - c0.user) + (c1.system - c0.system)
            samples.append({"arm": arm, "round": r, "wall_s": wall, "gib_per_s": args.gib / wall, "cpu_s": cpu,
                            "page_cache_dropped": dropped})
            print(f"{arm}: {wall:.2f} s, {args.gib / wall:.2f} GiB/s, CPU {cpu:.2f} s", flush=True)
    summary = {arm: {k: spread([s[k] for s in samples if s["arm"] == arm]) for k in ("wall_s", "gib_per_s", "cpu_s")}
               for arm in ARMS}
    receipt = {**header("tools/bench_fill.py"), "model": str(args.model), "gib": args.gib, "runs": args.runs,
               "summary": summary, "samples": samples}

    def cell(s: dict) -> str:
        return f"{s['median']:.2f} [{s['min']:.2f}–{s['max']:.2f}]"

    lines = [*markdown_head(f"Bringing {args.gib} GiB into memory: page cache vs O_DIRECT into fresh memory", receipt,
                            f"file {args.model}"),
             f"n = {args.runs} per arm, interleaved (order flipped each round), page cache dropped before each sample.",
             "", "| arm | wall s | GiB/s | CPU s (user + system) |", "|---|---|---|---|"]
    lines += [f"| {arm} | {cell(x['wall_s'])} | {cell(x['gib_per_s'])} | {cell(x['cpu_s'])} |"
              for arm, x in summary.items()]
    lines += ["", "Every sample:", ""] + [f"- {s['arm']} (round {s['round']}): {s['wall_s']:.2f} s, "
                                          f"{s['gib_per_s']:.2f} GiB/s, CPU {s['cpu_s']:.2f} s" for s in samples]
    json_path, md_path = write(args.out, f"fill_{receipt['date']}", receipt, "\n".join(lines) + "\n")
    print(md_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
