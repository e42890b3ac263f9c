"""Routing statistics of models on held-out text, side by side; receipt to evidence/.

For each model, each held-out document of the corpus (fixtures/corpus.py) is
one run: its first ``--prefill`` tokens are a prefill, the next ``--decode``
are fed one at a time (teacher-forced decode, as the cache sees them in
generation). Every route goes to a trace (the ``trace`` command's format) and
``route_stats.compute`` turns the trace into per-layer skew and locality and
per-predictor lookahead recall.

    python tools/routing_stats.py --models colibri_aio/models/colibri-tiny-q8_0.gguf,fixtures/tiny_f32.gguf
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "fixtures"))

import corpus  # noqa: E402

from colibri_aio.gguf.model import load  # noqa: E402
from colibri_aio.engine.mapped_source import MappedExpertSource  # noqa: E402
from colibri_aio.arch.qwen3moe import Qwen3MoE  # noqa: E402
from colibri_aio.cli.route_stats import TraceStats, compute, format_table  # noqa: E402
from colibri_aio.text.tokenizer import Tokenizer  # noqa: E402
from colibri_aio.cli.route_trace import TraceRecorder, read_trace  # noqa: E402
from colibri_aio.bench.receipt import header as receipt_header, host_line, write as write_receipt  # noqa: E402


async def trace_model(path: Path, docs: list[str], prefill: int, decode: int, out: Path) -> int:
    """Write the trace of ``docs`` through the model at ``path``; returns the number of runs."""
    model = load(path)
    tok = Tokenizer.from_gguf(model.reader)
    net = Qwen3MoE(model, MappedExpertSource(model), prefill + decode)
    runs = 0
    with open(out, "w", encoding="utf-8") as f:
        rec = TraceRecorder(model, f)
        rec.header()
        for doc in docs:
            ids = tok.encode(doc, parse_special=False)[: prefill + decode]
            if len(ids) < prefill + decode:
                continue
            net.reset()
            rec.run, rec.phase, rec.tokens = runs, "prefill", list(ids)  # teacher-forced: all ids known
            await net.forward(ids[:prefill], observer=rec)
            rec.phase = "decode"
            for t in ids[prefill:]:
                await net.forward([t], observer=rec)
            runs += 1
    return runs


def summary_row(name: str, s: TraceStats) -> dict:
    best = s.predictors[0] if s.predictors else None
    return {
        "model": name, "runs": s.runs, "positions": s.positions, "experts": s.expert_count,
        "top_k": s.expert_used_count,
        "entropy_mean": statistics.mean(x.entropy for x in s.layers),
        "top10_share_mean": statistics.mean(x.top10_share for x in s.layers),
        "breadth_mean": statistics.mean(x.breadth for x in s.layers),
        "locality_mean": statistics.mean(x.locality for x in s.layers),
        "uniform_locality": s.uniform_locality,
        "predictors": {p.predictor: {"recall_at_k": p.recall_at_k, "recall_at_2k": p.recall_at_2k,
                                     "precision_at_2k": p.precision_at_2k} for p in s.predictors},
        "best_predictor": best.predictor if best else None,
    }


def markdown(receipt: dict) -> str:
    lines = [f"# Routing statistics on held-out text — {receipt['date']}", "",
             f"{host_line(receipt)}, commit `{receipt['commit']}`; command `{receipt['command']}`", "",
             f"Each held-out document is one run: {receipt['prefill']} prefill tokens, then "
             f"{receipt['decode']} teacher-forced decode tokens.", "",
             "| model | runs | E / top-k | entropy (1 = uniform) | top-10% share | breadth per run | locality "
             "(uniform) | best predictor | its recall@k | recall@2k |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in receipt["rows"]:
        b = r["predictors"].get(r["best_predictor"], {})
        lines.append(f"| {r['model']} | {r['runs']} | {r['experts']} / {r['top_k']} | {r['entropy_mean']:.3f} | "
                     f"{r['top10_share_mean']:.3f} | {r['breadth_mean']:.3f} | {r['locality_mean']:.3f} "
                     f"({r['uniform_locality']:.3f}) | {r['best_predictor']} | {b.get('recall_at_k', 0):.3f} | "
                     f"{b.get('recall_at_2k', 0):.3f} |")
    lines += ["", "Lookahead predictors (recall@k = precision@k of predicting layer L+1's top-k from layer L):", ""]
    for r in receipt["rows"]:
        lines.append(f"- {r['model']}: " + ", ".join(
            f"{k} {v['recall_at_k']:.3f}" for k, v in r["predictors"].items()))
    lines += ["", "Per-layer tables:", ""]
    for name, table in receipt["tables"].items():
        lines += [f"## {name}", "", "```", table, "```", ""]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", required=True, help="comma-separated GGUF paths")
    p.add_argument("--docs", type=int, default=40, help="held-out documents (runs) per model")
    p.add_argument("--prefill", type=int, default=32)
    p.add_argument("--decode", type=int, default=96)
    p.add_argument("--out", type=Path, default=ROOT / "evidence")
    args = p.parse_args()
    docs = corpus.texts("heldout")[: args.docs]
    rows, tables = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for m in args.models.split(","):
            path = Path(m)
            trace = Path(tmp) / f"{path.stem}.jsonl"
            asyncio.run(trace_model(path, docs, args.prefill, args.decode, trace))
            stats = compute(read_trace(str(trace)))
            rows.append(summary_row(path.name, stats))
            tables[path.name] = format_table(stats)
            print(tables[path.name], flush=True)
    receipt = {**receipt_header("tools/routing_stats.py"), "prefill": args.prefill, "decode": args.decode,
               "rows": rows, "tables": tables}
    write_receipt(args.out, "routing_stats", receipt, markdown(receipt))
    print(markdown(receipt))
    return 0


if __name__ == "__main__":
    sys.exit(main())
