"""Fuzz the model-file reader: seeded mutants of the fixtures through plan, doctor --verify, logits, Engine.open
and a chat prompt; every outcome must be a clean result or one error line with exit status 2.

    flock -s /work/cpu.lock python tools/fuzz_gguf.py --cases 5000 --seed 1
    python tools/fuzz_gguf.py --cases 200 --fixtures fixtures/tiny_q8_0.gguf --no-receipt --show-failures

Each case key (``<fixture>/<seed>-<i>``) rebuilds the same mutant, so a
failure in the receipt is reproduced with ``--replay KEY``. The receipt
(``evidence/fuzz_<stamp>.json`` and ``.md``) has host, commit, command, the
outcome classes per action, mutation kind and fixture, the refusal messages by
kind, hangs, tracebacks, peak RSS per case, and every case in one line each.
Exit status 1 when any case failed.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))

from colibri_aio.bench.receipt import git_state, header, stamp, write  # noqa: E402
from gguf_fuzz.campaign import ROOT, CaseResult, run_campaign  # noqa: E402
from gguf_fuzz.cases import ACTIONS  # noqa: E402
from gguf_fuzz.summary import Summary  # noqa: E402

FIXTURES = ROOT / "fixtures"


def default_fixtures() -> list[Path]:
    """The shipped model, the tiny fixtures, the quant-type fixtures and the family fixtures
    (architectures the engine may refuse: a refusal is a clean outcome); no ``*_bad`` file."""
    paths = [ROOT / "colibri_aio" / "models" / "colibri-tiny-q8_0.gguf"]
    paths += sorted(p for p in FIXTURES.glob("*.gguf") if not p.is_symlink())
    paths += sorted((FIXTURES / "quant_types").glob("*.gguf"))
    return [p for p in paths if not p.stem.endswith("_bad")]


def outcome_code(r: CaseResult) -> str:
    """One letter per action in ACTIONS order: o ok, r refused, F failed, - not run; or the hang or crash."""
    if r.hang or r.crash:
        return f"hang in {r.hang}" if r.hang else "crash"
    letters = {o["action"]: {"ok": "o", "refused": "r"}.get(o["cls"], "F") for o in r.outcomes}
    return "".join(letters.get(a, "-") for a in ACTIONS)


def _markdown(receipt: dict, summary: dict) -> str:
    m = summary["memory"]
    lines = [
        f"# Fuzzed model files, {receipt['date']}",
        "",
        f"`{receipt['command']}` on `{receipt['host']}` ({receipt['cpus']} CPUs, load {receipt['load_average'][0]:.1f}),"
        f" commit `{receipt['commit']}`, {receipt['seconds']:.0f} s.",
        "",
        f"**{summary['cases']} mutated files** of {len(receipt['fixtures'])} fixtures, each through "
        f"`plan`, `doctor --verify`, `logits`, `Engine.open` (+ encode/decode) and a chat prompt: "
        f"**{summary['tracebacks']} tracebacks, {summary['hangs']} hangs, {summary['crashes']} crashed workers, "
        f"{summary['over_memory']} cases over the memory bound; {summary['failures']} failures in all** (outcomes "
        f"that were not a clean result or one error line with exit 2, hangs, crashes, memory).",
        "",
        f"Peak RSS of one case (worker process, reset before each case): max {m['peak_rss_max_mib']} MiB, "
        f"median {m['peak_rss_median_mib']} MiB; the most one case added above the worker's RSS before it: "
        f"{m['peak_growth_in_one_case_max_mib']} MiB, bound {m['growth_bound_mib']} MiB, cases over it: "
        f"{m['cases_over_the_bound']} (largest fixture {receipt['largest_fixture_mib']} MiB; "
        f"address-space cap {receipt['address_space_gib']} GiB above the worker's start).",
        "",
        "| action | " + " | ".join(sorted({c for v in summary["outcomes_by_action"].values() for c in v})) + " |",
    ]
    classes = sorted({c for v in summary["outcomes_by_action"].values() for c in v})
    lines.append("|---|" + "---|" * len(classes))
    for action, counts in summary["outcomes_by_action"].items():
        lines.append(f"| {action} | " + " | ".join(str(counts.get(c, 0)) for c in classes) + " |")
    lines += ["", "How far the mutants got (first action refused):", ""]
    lines += [f"- {k}: {v}" for k, v in sorted(summary["cases_by_last_clean_action"].items(), key=lambda kv: -kv[1])]
    lines += ["", "Cases by mutation kind (worst outcome of the case):", "", "| kind | ok | refused | failed |",
              "|---|---|---|---|"]
    for kind, c in summary["cases_by_mutation_kind"].items():
        lines.append(f"| {kind} | {c.get('ok', 0)} | {c.get('refused', 0)} | {c.get('failed', 0)} |")
    lines += ["", f"Refusals naming the file: {summary['refusals_naming_the_file']}. Most frequent refusal "
                  f"messages (path as FILE, numbers as N):", ""]
    lines += [f"- {n} x `{msg}`" for msg, n in list(summary["refusal_messages"].items())[:25]]
    if summary["first_failures"]:
        lines += ["", "Failures:", ""] + [f"- `{f}`" for f in summary["first_failures"][:20]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", type=int, default=5000, help="mutated files to run (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="campaign seed (default: %(default)s)")
    p.add_argument("--fixtures", type=Path, nargs="+", default=None, help="files to mutate (default: see source)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds one action may take (default: %(default)s)")
    p.add_argument("--kernels", default=None, help="--kernels for logits and Engine.open (default: the engine's)")
    p.add_argument("--render-seconds", type=float, default=None,
                   help="chat template time limit in the workers (default: the engine's)")
    p.add_argument("--address-space", type=float, default=4.0, metavar="GIB",
                   help="RLIMIT_AS headroom of a worker above its size at start (default: %(default)s)")
    p.add_argument("--nice", type=int, default=10, help="niceness of the workers (default: %(default)s)")
    p.add_argument("--replay", metavar="KEY", help="run one case key (fixture/seed-i) and print its outcomes")
    p.add_argument("--out", type=Path, default=ROOT / "evidence", help="receipt folder")
    p.add_argument("--no-receipt", action="store_true")
    p.add_argument("--show-failures", action="store_true", help="print each failure as it happens")
    args = p.parse_args(argv)
    fixtures = [f.resolve() for f in (args.fixtures or default_fixtures())]
    by_name = {f.name: f for f in fixtures}
    opts = dict(timeout=args.timeout, kernels=args.kernels, address_space=int(args.address_space * (1 << 30)),
                nice=args.nice, render_seconds=args.render_seconds)
    if args.replay:
        name, _, rest = args.replay.partition("/")
        seed, _, index = rest.partition("-")
        fixture = by_name.get(name) or next(f for f in default_fixtures() if f.name == name)
        results = run_campaign([fixture], int(index) + 1, seed=int(seed), first=int(index), **opts)
        for r in results:
            print(r.key, r.kinds, r.notes, r.hang or r.crash or "", f"peak {r.peak_rss >> 20} MiB")
            for o in r.outcomes:
                print(f"  {o['action']:7} {o['cls']:13} {o['seconds']:6.2f}s {o['detail']}")
        return int(any(r.failed for r in results))

    summary, rows = Summary(), []
    t0 = time.monotonic()

    def report(r: CaseResult) -> None:
        summary.add(r)
        rows.append([r.key, "+".join(r.kinds), outcome_code(r), r.peak_rss >> 10])
        if args.show_failures and r.failed:
            print("FAILED", r.key, r.kinds, r.notes, r.hang or r.crash or [o for o in r.outcomes
                                                                          if o["cls"] not in ("ok", "refused")],
                  flush=True)
        if summary.cases % 250 == 0:
            print(f"{summary.cases}/{args.cases} cases, {summary.failed} failed, "
                  f"{time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)

    run_campaign(fixtures, args.cases, seed=args.seed, report=report, **opts)
    doc = summary.as_dict()
    print(f"{summary.cases} cases: {summary.tracebacks} tracebacks, {summary.hangs} hangs, {summary.crashes} crashes, "
          f"{summary.over_memory} over the memory bound, {len(summary.failures)} failures in all; peak RSS max "
          f"{doc['memory']['peak_rss_max_mib']} MiB; "
          f"{time.monotonic() - t0:.0f} s")
    if not args.no_receipt:
        receipt = {**header("tools/fuzz_gguf.py"), "seconds": time.monotonic() - t0,
                   "modified": git_state("colibri_aio", "io", "kernels", "tools")["modified"],
                   "fixtures": [str(f.relative_to(ROOT)) for f in fixtures],
                   "largest_fixture_mib": round(max(f.stat().st_size for f in fixtures) / (1 << 20), 1),
                   "address_space_gib": args.address_space, "timeout_s": args.timeout, "kernels": args.kernels,
                   "render_seconds": args.render_seconds, "summary": doc,
                   "case_columns": ["key", "mutations", f"outcomes ({', '.join(ACTIONS)}: o ok, r refused, F failed, "
                                                        f"- not run)", "peak_rss_kib"], "cases": rows}
        name = f"fuzz_{stamp()}"
        write(args.out, name, receipt, _markdown(receipt, doc))
        print(f"receipt: {args.out / name}.json, .md")
    return 1 if summary.failed else 0


if __name__ == "__main__":
    sys.exit(main())
