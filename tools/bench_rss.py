"""Peak RSS of ``run`` against the RAM budget it was given (design invariant 3).

Each run is a fresh ``python -m colibri_aio run --ram-budget B`` process; its
peak RSS is the kernel's ru_maxrss for that child (os.wait4), so it counts
everything the process touched: Python, NumPy, the compiled kernels, the
trunk, the KV cache, the buffer pool and its working memory. The claim
checked is peak RSS <= budget + 10%.

    python tools/bench_rss.py MODEL.gguf --budgets 1.5G,3G,6G --runs 5
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from colibri_aio.policy.budget import parse_size
from colibri_aio.bench.receipt import header as receipt_header, host_line, spread, write as write_receipt

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 1.10


def one_run(model: Path, budget: str, tokens: int, prompt: str, ctx: int) -> dict:
    """One ``run`` process; its peak RSS from the kernel and the plan line it printed."""
    cmd = [sys.executable, "-m", "colibri_aio", "run", "--model", str(model), "--ram-budget", budget,
           "--max-tokens", str(tokens), "--prompt", prompt, "--ctx", str(ctx), "--no-stats"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stderr = proc.stderr.read() if proc.stderr is not None else ""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    plan = next((ln for ln in stderr.splitlines() if "plan:" in ln), "")
    out = {"budget": budget, "budget_bytes": parse_size(budget), "peak_rss": usage.ru_maxrss * 1024,
           "returncode": proc.returncode, "wall_s": time.perf_counter() - t0, "plan": plan.strip()}
    if proc.returncode != 0:
        out["error"] = (stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
    return out


def markdown(receipt: dict) -> str:
    lines = [f"# Peak RSS against the RAM budget — {receipt['date']}", "",
             f"{host_line(receipt)}, commit `{receipt['commit']}`, model `{receipt['model']}` "
             f"({receipt['model_bytes'] / 1e9:.2f} GB), {receipt['tokens']} tokens per run, context {receipt['ctx']}, "
             "budgets interleaved.",
             "", f"Command: `{receipt['command']}`", "",
             "| budget | n ok | peak RSS GiB median [min–max] | peak ÷ budget, max | within budget + 10% |",
             "|---|---|---|---|---|"]
    for b, s in receipt["summary"].items():
        if not s["n"]:
            lines.append(f"| {b} | 0 | — | — | failed: {s['errors']} |")
            continue
        lines.append(f"| {b} | {s['n']} | {s['median'] / 2**30:.2f} [{s['min'] / 2**30:.2f}–{s['max'] / 2**30:.2f}] | "
                     f"{s['max_ratio']:.3f} | {'yes' if s['max_ratio'] <= TOLERANCE else '**no**'} |")
    lines += ["", "Peak RSS is ru_maxrss of each run's process (everything it touched). The plan line of "
              "every run is in the JSON receipt beside this file."]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument("--budgets", default="1.5G,3G,6G")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt", default="The list type")
    p.add_argument("--ctx", type=int, default=4096, help="KV-cache positions (the plan sizes the KV cache from it)")
    p.add_argument("--out", type=Path, default=ROOT / "evidence")
    args = p.parse_args()
    budgets = args.budgets.split(",")
    runs = []
    for i in range(args.runs):
        for b in budgets:
            r = one_run(args.model, b, args.tokens, args.prompt, args.ctx)
            r["run"] = i
            runs.append(r)
            print(f"{b}: peak {r['peak_rss'] / 2**30:.2f} GiB, exit {r['returncode']}", flush=True)
    summary = {}
    for b in budgets:
        ok = [r for r in runs if r["budget"] == b and r["returncode"] == 0]
        peaks = [r["peak_rss"] for r in ok]
        summary[b] = {"n": len(ok), "errors": sorted({r["error"] for r in runs if r["budget"] == b and "error" in r})}
        if peaks:
            summary[b].update(spread(peaks), max_ratio=max(peaks) / parse_size(b))
    receipt = {**receipt_header("tools/bench_rss.py"), "model": args.model.name,
               "model_bytes": args.model.stat().st_size, "tokens": args.tokens, "ctx": args.ctx, "summary": summary, "runs": runs}
    write_receipt(args.out, f"rss_{receipt['date']}", receipt, markdown(receipt))
    print(markdown(receipt))
    return 0 if all(s["n"] == args.runs and s["max_ratio"] <= TOLERANCE for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
