"""Same-run A/B of two commits: one benchmark command run under each, interleaved, n rounds.

Each commit is exported (``git archive``) and installed (``pip wheel`` then
``pip install --target``) into a scratch directory outside the tree; a run of
commit X is the command with that commit's ``tools/`` script, its installed
package first on ``PYTHONPATH``, in a fresh process. Every round runs the
command once per commit and condition, alternating which commit goes first,
optionally holding an exclusive ``flock`` for the round (released between
rounds; a shared one for the untimed warm-up). Each run prints JSON lines, one per sample; samples are grouped by
the ``--key`` fields and the ``--metric`` compared: per group the median
[min–max] of each commit and the median [min–max] of the per-round B/A ratios,
beside each commit's own run-to-run spread (max/min).

    python tools/bench_commits.py ca91892 HEAD --rounds 5 --conditions idle,saturated \\
        --lock /work/cpu.lock -- tools/bench_prefetch.py --model M.gguf --runs 1 --tokens 32 \\
        --conditions {condition} --out {scratch}/receipts

``{condition}`` and ``{scratch}`` in the command are filled in per run.
``--background COND=CMD`` runs CMD (e.g. fio loading the disk) through both
commits' runs of COND in each round, so the pair shares one load: a load that
each run started for itself could settle differently from run to run.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import io
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from colibri_aio.bench.receipt import git_state, header, host_line, ROOT, spread, stamp, write


def export(commit: str, scratch: Path) -> tuple[str, Path, Path]:
    """``commit``'s tree under ``scratch`` and its package installed beside it: (sha, tree, site)."""
    sha = subprocess.run(["git", "rev-parse", commit], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    tree, site, wheels = scratch / sha[:12] / "tree", scratch / sha[:12] / "site", scratch / sha[:12] / "wheel"
    if not site.is_dir():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", "--format=tar", sha], cwd=ROOT, capture_output=True,
                                 check=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(tree, filter="data")
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(tree)],
                       check=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                        *map(str, wheels.glob("*.whl"))], check=True)
    return sha, tree, site


@contextlib.contextmanager
def holding(lock: Path | None, mode: int) -> Iterator[None]:
    """Hold a flock of ``mode`` (LOCK_EX, LOCK_SH) on ``lock`` (nothing when None)."""
    if lock is None:
        yield
        return
    with open(lock, "a") as f:
        fcntl.flock(f, mode)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def background(command: str | None, settle: float) -> Iterator[None]:
    """Run ``command`` (in its own session) for the duration; nothing when None."""
    if command is None:
        yield
        return
    proc = subprocess.Popen(shlex.split(command), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        time.sleep(settle)  # let the load reach its steady state
        if proc.poll() is not None:
            raise SystemExit(f"background command exited ({proc.returncode}): {command}")
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()


def run_once(tree: Path, site: Path, command: list[str], condition: str, scratch: Path) -> list[dict]:
    """One run of ``command`` under the commit installed in ``site``; its JSON lines."""
    argv = [a.replace("{condition}", condition).replace("{scratch}", str(scratch)) for a in command]
    script = tree / argv[0]
    path = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run([sys.executable, str(script), *argv[1:]], env=env, cwd=tree, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise SystemExit(f"{script} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    samples = []
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                samples.append(json.loads(line))
    if not samples:
        raise SystemExit(f"{script} printed no JSON lines:\n{done.stdout[-2000:]}")
    return samples


def summarise(runs: list[dict], keys: list[str], metric: str) -> list[dict]:
    """Per group: each commit's spread of ``metric`` over every sample, and the spread of per-round B/A ratios
    (of each round's medians, when a run prints several samples). A key is a sample's field, or the run's
    own (``condition``)."""
    groups: dict[tuple, dict[str, dict[int, list[float]]]] = {}
    failed: dict[tuple, dict[str, int]] = {}
    for r in runs:
        group = tuple(r["sample"].get(k, r.get(k)) for k in keys)
        by = groups.setdefault(group, {"a": {}, "b": {}})
        value = r["sample"].get(metric)
        if value is None:   # a failed run (its sample carries an error instead): counted, not summarised
            failed.setdefault(group, {"a": 0, "b": 0})[r["arm"]] += 1
            continue
        by[r["arm"]].setdefault(r["round"], []).append(value)
    rows = []
    for group, by in groups.items():
        a = {i: statistics.median(v) for i, v in by["a"].items()}
        b = {i: statistics.median(v) for i, v in by["b"].items()}
        every_a, every_b = [x for v in by["a"].values() for x in v], [x for v in by["b"].values() for x in v]
        ratios = [b[i] / a[i] for i in sorted(a.keys() & b.keys()) if a[i]]
        rows.append({**dict(zip(keys, group)), "a": _spread_or_none(every_a), "b": _spread_or_none(every_b),
                     "ratio": spread(ratios) if ratios else None, "ratios": ratios,
                     "a_spread": _max_over_min(every_a), "b_spread": _max_over_min(every_b),
                     "failed": failed.get(group, {"a": 0, "b": 0})})
    return rows


def _spread_or_none(xs: list[float]) -> dict[str, float] | None:
    return spread(xs) if xs else None


def _max_over_min(xs: list[float]) -> float | None:
    return max(xs) / min(xs) if xs and min(xs) else None


def markdown(receipt: dict) -> str:
    keys, metric = receipt["keys"], receipt["metric"]
    a, b = receipt["a"], receipt["b"]
    lines = [f"# Same-run A/B of two commits — {receipt['date']}", "",
             f"{host_line(receipt)}, tool at commit `{receipt['commit']}`; "
             f"A = `{a['sha'][:10]}` ({a['name']}), B = `{b['sha'][:10]}` ({b['name']}); {receipt['rounds']} rounds, "
             f"each running A and B once per condition in alternating order"
             f"{', each round under an exclusive lock' if receipt['lock'] else ''}.", "",
             f"Command: `{receipt['command']}`", "",
             f"Benchmark run per commit: `{' '.join(receipt['benchmark'])}`", "",
             *[f"Through both commits' runs of `{c}` in each round: `{cmd}`"
               for c, cmd in receipt["background"].items()],
             "",
             f"| {' | '.join(keys)} | A {metric} median [min–max] | B {metric} median [min–max] | "
             f"B/A per round, median [min–max] | A spread (max/min) | B spread (max/min) |",
             "|" + "---|" * (len(keys) + 5)]

    def fmt(s: dict | None) -> str:
        return "-" if s is None else f"{s['median']:.3f} [{s['min']:.3f}–{s['max']:.3f}]"

    def ratio(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    failures = []
    for row in receipt["summary"]:
        lines.append(f"| {' | '.join(str(row[k]) for k in keys)} | {fmt(row['a'])} | {fmt(row['b'])} | "
                     f"{fmt(row['ratio'])} | {ratio(row['a_spread'])} | {ratio(row['b_spread'])} |")
        failed = row.get("failed", {"a": 0, "b": 0})
        if failed["a"] or failed["b"]:
            failures.append(f"{', '.join(f'{k} {row[k]}' for k in keys)}: {failed['a']} of A's runs and "
                            f"{failed['b']} of B's printed no {metric} (their errors are in the JSON receipt)")
    if failures:
        lines += ["", "Runs without a value, left out of the medians:", "", *[f"- {f}" for f in failures]]
    lines += ["", "Every sample of every run is in the JSON receipt beside this file."]
    return "\n".join(lines) + "\n"


def resummarise(args: argparse.Namespace) -> int:
    """A receipt's runs summarised again by other keys or another metric, written beside it."""
    receipt = json.loads(args.summarise.read_text())
    keys = args.key.split(",")
    receipt.update(keys=keys, metric=args.metric, summary=summarise(receipt["runs"], keys, args.metric))
    out = args.summarise.with_name(f"{args.summarise.stem}_{args.metric}")
    out.with_suffix(".json").write_text(json.dumps(receipt, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(receipt))
    print(markdown(receipt))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", help="commit A (the reference)")
    p.add_argument("b", help="commit B (the change)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per commit first (kernel caches, page cache)")
    p.add_argument("--conditions", default="default", help="comma-separated values for {condition}")
    p.add_argument("--key", default="condition,prefetch", help="sample fields that name a group")
    p.add_argument("--metric", default="tok_s")
    p.add_argument("--lock", type=Path, default=None,
                   help="hold an exclusive flock on this file for each round (a shared one for the warm-up)")
    p.add_argument("--background", action="append", default=[], metavar="COND=CMD",
                   help="run CMD through both commits' runs of condition COND in each round (repeatable)")
    p.add_argument("--settle", type=float, default=2.0, help="seconds a background load runs before the first run")
    p.add_argument("--scratch", type=Path, default=None, help="where the commits are installed (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory")
    p.add_argument("--out", type=Path, default=ROOT / "evidence")
    p.add_argument("--name", default="commits", help="receipt file name prefix")
    p.add_argument("--summarise", type=Path, default=None, metavar="JSON",
                   help="write the receipt JSON again (beside itself) grouped by --key on --metric; runs nothing")
    p.usage = "%(prog)s A B [options] -- SCRIPT [ARGS...]   (SCRIPT: a tools/ script both commits have)"
    argv = sys.argv[1:]
    if "--summarise" in argv:
        return resummarise(p.parse_args(["-", "-", *argv]))
    split = argv.index("--") if "--" in argv else len(argv)
    args, command = p.parse_args(argv[:split]), argv[split + 1:]
    if not command:
        p.error("give the benchmark command after --")
    loads = dict(item.split("=", 1) for item in args.background)
    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="bench-commits-"))
    try:
        arms = {name: export(commit, scratch) for name, commit in (("a", args.a), ("b", args.b))}
        conditions = args.conditions.split(",")
        with holding(args.lock, fcntl.LOCK_SH):  # untimed, but CPU-heavy: not while others time theirs
            for _, tree, site in arms.values():
                for _ in range(args.warmup):
                    run_once(tree, site, command, conditions[0], scratch)
        runs = []
        for rnd in range(args.rounds):
            order = ["a", "b"] if rnd % 2 == 0 else ["b", "a"]
            with holding(args.lock, fcntl.LOCK_EX):
                for condition in conditions:
                    with background(loads.get(condition), args.settle):
                        for name in order:
                            _, tree, site = arms[name]
                            for sample in run_once(tree, site, command, condition, scratch):
                                runs.append({"round": rnd, "arm": name, "condition": condition, "sample": sample})
                                print(json.dumps(runs[-1]), flush=True)
        keys = args.key.split(",")
        receipt = {**header("tools/bench_commits.py"), "tool_commit": git_state()["sha"],
                   "a": {"name": args.a, "sha": arms["a"][0]}, "b": {"name": args.b, "sha": arms["b"][0]},
                   "rounds": args.rounds, "warmup": args.warmup, "lock": str(args.lock) if args.lock else None,
                   "background": loads,
                   "benchmark": command, "keys": keys, "metric": args.metric,
                   "summary": summarise(runs, keys, args.metric), "runs": runs,
                   "note": "shared 2-vCPU machine: other jobs may run between rounds (and during them when no lock "
                           "is held)"}
        name = f"{args.name}_{stamp()}"
        write(args.out, name, receipt, markdown(receipt))
        print(markdown(receipt))
    finally:
        if not args.keep and args.scratch is None:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
