"""What a disk fill running beside decode costs the decode: step time of a resident model while another file's
bytes are brought into memory, by each way the engine (or another process) can bring them in.

The engine opens ``--model`` (every expert fits: the page cache holds them), decodes until warm, then, per
sample, drops the page cache (the model's mapped pages stay) and times ``--steps`` decode steps while one of:

- none: nothing else runs (the reference of the round);
- thread: a thread of this process brings ``--gib`` of ``--fill-file`` into the page cache with
  ``posix_fadvise(WILLNEED)`` + ``MADV_POPULATE_READ`` of its own mapping through libc (io.madvise, the GIL
  released), as the mmap reader's warm start does;
- thread-gil: the same through Python's ``mmap.madvise``, which holds the GIL for the whole call;
- child: the same fill in a child process (its page tables, not ours);
- o-direct: a child process reads the same bytes with O_DIRECT into its own memory (no page cache).

Each sample's figure is the mean step time of the ``--steps`` steps that follow the fill's start at once
(a fill that stops this thread shows there), beside whether the fill was still running after the last of
them. Arms are interleaved, their order rotated each round; the per-round ratio to ``none`` is the result.

    python tools/bench_fill_interference.py --model 8L.gguf --fill-file BIG.gguf [--gib 2] [--runs 5]
"""
from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_fill import fill_page_cache  # noqa: E402
from bench_scale import token_ids  # noqa: E402
from colibri_aio.bench.lock import exclusive  # noqa: E402
from colibri_aio.bench.pagecache import drop_page_cache  # noqa: E402
from colibri_aio.bench.receipt import header, markdown_head, spread, write  # noqa: E402

ARMS = ("none", "thread", "thread-gil", "child", "o-direct")
CHILD = ("import sys; sys.path.insert(0, sys.argv[1]); from bench_fill import {fn}; "
         "from pathlib import Path; {fn}(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))")


class Fill:
    """One arm's fill of ``nbytes`` at ``offset`` of ``path``, started now; ``running`` while it reads."""

    def __init__(self, arm: str, path: Path, offset: int, nbytes: int) -> None:
        self._thread: threading.Thread | None = None
        self._child: subprocess.Popen[bytes] | None = None
        if arm in ("thread", "thread-gil"):
            self._thread = threading.Thread(target=fill_page_cache, args=(path, offset, nbytes, arm == "thread"))
            self._thread.start()
        elif arm in ("child", "o-direct"):
            fn = "fill_page_cache" if arm == "child" else "fill_o_direct"
            self._child = subprocess.Popen([sys.executable, "-c", CHILD.format(fn=fn), str(Path(__file__).parent),
                                            str(path), str(offset), str(nbytes)])

    @property
    def running(self) -> bool:
        if self._thread is not None:
            return self._thread.is_alive()
        return self._child is not None and self._child.poll() is None

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
        if self._child is not None:
            self._child.wait()


async def measure(args: argparse.Namespace) -> list[dict]:
    from colibri_aio.engine.engine import Engine

    engine = await Engine.open(args.model)
    samples: list[dict] = []
    try:
        ids = token_ids(0, 32 + 40 + args.runs * len(ARMS) * args.steps)
        await engine.prefill(ids[:32])
        at = 32
        for token in ids[at:at + 40]:  # warm: every step's graphs traced, its experts in
            await engine.net.forward([token])
        at += 40
        offset, nbytes = 1 << 30, args.gib << 30
        for r in range(args.runs):
            order = ARMS[r % len(ARMS):] + ARMS[:r % len(ARMS)]
            for arm in order:
                with exclusive(args.lock):
                    dropped = drop_page_cache()
                    fill = Fill(arm, args.fill_file, offset, nbytes)
                    steps: list[float] = []
                    t0 = time.perf_counter()
                    for token in ids[at:at + args.steps]:
                        await engine.net.forward([token])
                        steps.append(time.perf_counter() - t0)
                    outlasted = arm == "none" or fill.running
                    at += args.steps
                    fill.wait()
                if arm != "none":
                    offset += nbytes  # the next fill reads bytes no earlier sample left in the page cache
                if offset + nbytes > args.fill_file.stat().st_size:
                    offset = 1 << 30
                ends = [round(s * 1e3, 3) for s in steps]  # each step's end, ms from the fill's start
                sample = {"arm": arm, "round": r, "steps": len(steps), "page_cache_dropped": dropped,
                          "step_ends_ms": ends, "mean_ms": ends[-1] / len(ends), "fill_outlasted_steps": outlasted}
                samples.append(sample)
                print(f"round {r} {arm}: {sample['mean_ms']:.1f} ms a step"
                      + ("" if outlasted else " (the fill ended before the last step)"), flush=True)
    finally:
        await engine.aclose()
    return samples


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True, help="a model whose experts all fit in memory")
    p.add_argument("--fill-file", type=Path, required=True, help="a large file to bring in beside the decode")
    p.add_argument("--gib", type=int, default=2, help="bytes of --fill-file each sample brings in")
    p.add_argument("--steps", type=int, default=20, help="decode steps timed per sample")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--lock", type=Path)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "evidence")
    args = p.parse_args()
    for path in (args.model, args.fill_file):
        if not path.is_file():
            print(f"bench_fill_interference: {path}: no such file", file=sys.stderr)
            return 2
    if args.fill_file.stat().st_size < (1 << 30) + (args.gib << 30):
        print(f"bench_fill_interference: {args.fill_file} is smaller than {args.gib + 1} GiB", file=sys.stderr)
        return 2
    samples = asyncio.run(measure(args))

    summary = {arm: spread([s["mean_ms"] for s in samples if s["arm"] == arm]) for arm in ARMS
               if any(s["arm"] == arm for s in samples)}
    by_round = {(s["round"], s["arm"]): s["mean_ms"] for s in samples}
    ratios = {arm: spread([by_round[(r, arm)] / by_round[(r, "none")] for r in range(args.runs)
                           if (r, arm) in by_round and (r, "none") in by_round])
              for arm in ARMS[1:] if any(k[1] == arm for k in by_round)}
    receipt = {**header("tools/bench_fill_interference.py"), "model": str(args.model),
               "fill_file": str(args.fill_file), "gib": args.gib, "steps": args.steps, "runs": args.runs,
               "summary": summary, "ratio_to_none": ratios, "samples": samples}

    def cell(s: dict | None, fmt: str = "{:.1f}") -> str:
        return "—" if not s else f"{fmt.format(s['median'])} [{fmt.format(s['min'])}–{fmt.format(s['max'])}]"

    lines = [*markdown_head("Decode beside a disk fill", receipt, f"model {args.model}, fill file {args.fill_file}"),
             f"Decode step time of the resident model while {args.gib} GiB of the fill file come in (page cache "
             f"dropped before each sample, the model's mapped pages staying): the mean of the {args.steps} steps "
             f"that follow the fill's start; n = {args.runs} rounds, arms rotated.", "",
             "| fill | step ms | ÷ none, per round |", "|---|---|---|"]
    lines += [f"| {arm} | {cell(summary.get(arm))} | {cell(ratios.get(arm), '{:.2f}') if arm != 'none' else '1'} |"
              for arm in ARMS]
    lines += ["", "Every sample (each step's end, ms from the fill's start):", ""] + [
        f"- {s['arm']} (round {s['round']}): {s['mean_ms']:.1f} ms a step"
        f"{'' if s['fill_outlasted_steps'] else ', the fill ended before the last step'}: {s['step_ends_ms']}"
        for s in samples]
    json_path, md_path = write(args.out, f"fill_interference_{receipt['date']}", receipt, "\n".join(lines) + "\n")
    print(md_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
