"""``replay``: route trace files through the expert-cache simulation of :mod:`colibri_aio.policy.replay`.

Reads the trace files, expands the option lists into a grid of
configurations, and prints a table or one JSON document.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from colibri_aio.cli.route_trace import read_trace
from colibri_aio.errors import UserError
from colibri_aio.policy.replay import REPLAY_POLICIES, ReplayResult, Step, Trace, run_grid, steps_from_records


def load_traces(paths: Sequence[str], split_prefill: bool = False) -> Trace:
    """Read one or more trace files of the same model; their runs follow one another."""
    header: dict[str, Any] | None = None
    steps: list[Step] = []
    for path in paths:
        try:
            records = read_trace(path)
            h = next(records)
        except (OSError, StopIteration, ValueError) as exc:
            raise UserError(f"{path}: cannot read route trace ({exc.__class__.__name__})") from None
        shape = ("block_count", "leading_dense_block_count", "expert_count", "expert_used_count", "expert_nbytes")
        if header is not None and any(h.get(k) != header.get(k) for k in shape):
            raise UserError(f"{path}: trace of a differently shaped model than {paths[0]}")
        header = header or h
        offset = 1 + max((s.run for s in steps), default=-1)
        steps += steps_from_records(records, run_offset=offset, split_prefill=split_prefill)
    assert header is not None
    return Trace(header["block_count"], header["expert_count"], header["expert_used_count"],
                 header["expert_nbytes"], tuple(header.get("predictors", ())), steps,
                 header.get("leading_dense_block_count", 0))


def parse_list(text: str, allowed: Sequence[str] | None, option: str) -> list[str]:
    """Comma-separated values of a command-line option; ``all`` expands to ``allowed``."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if allowed is not None and "all" in items:
        return list(allowed)
    bad = [t for t in items if allowed is not None and t not in allowed]
    if not items or bad:
        choices = ", ".join(allowed) if allowed is not None else "values"
        raise UserError(f"{option}: expected comma-separated {choices}, got {text!r}")
    return items


def parse_sizes(text: str) -> list[int]:
    """``--cache-per-layer 1,2,4`` -> [1, 2, 4]; ``pow2`` -> 1, 2, 4, … (capped later)."""
    try:
        sizes = [int(t) for t in parse_list(text, None, "--cache-per-layer")]
    except ValueError:
        raise UserError(f"--cache-per-layer: expected comma-separated integers, got {text!r}") from None
    if min(sizes) < 1:
        raise UserError("--cache-per-layer must be at least 1")
    return sizes


def format_results(results: Sequence[ReplayResult]) -> str:
    """A plain-text table: one row per configuration."""
    lines = [f"{'policy':11s} {'scope':6s} {'N/layer':>7s} {'prefetch':>19s} {'hit rate':>8s} "
             f"{'pinned':>6s} {'cached':>6s} {'prefet':>6s} {'misses':>6s} {'MB read':>9s} "
             f"{'MB wasted':>9s} {'recall':>6s} {'prec':>6s}"]
    for r in results:
        d = r.as_dict()
        la = d.get("lookahead", {})
        lines.append(
            f"{d['policy']:11s} {d['scope']:6s} {d['cache_per_layer']:7d} {str(d['prefetch'] or '-'):>19s} "
            f"{d['hit_rate']:8.3f} {d['pinned_hits']:6d} {d['cached_hits']:6d} {d['prefetch_hits']:6d} "
            f"{d['misses']:6d} {(d['demand_bytes'] + d['prefetch_bytes']) / 1e6:9.2f} "
            f"{d['wasted_bytes'] / 1e6:9.2f} {_ratio(la.get('recall'))} {_ratio(la.get('precision'))}")
    return "\n".join(lines)


def _ratio(x: float | None) -> str:
    return f"{x:6.3f}" if x is not None else f"{'-':>6s}"


def summarise(per_trace: Sequence[Sequence[ReplayResult]]) -> list[dict[str, Any]]:
    """Median, min and max hit rate and bytes per token of each configuration over several traces."""
    rows = []
    for same in zip(*per_trace):
        rates = [r.stats.hit_rate for r in same]
        per_tok = [r.as_dict()["bytes_per_token"] for r in same]
        d = same[0].as_dict()
        rows.append({k: d[k] for k in ("policy", "scope", "cache_per_layer", "slots", "prefetch")} | {
            "traces": len(same),
            "hit_rate": {"median": statistics.median(rates), "min": min(rates), "max": max(rates)},
            "bytes_per_token": {"median": statistics.median(per_tok), "min": min(per_tok), "max": max(per_tok)},
            "recall": _median_of(same, "recall") if d["prefetch"] else None,
            "precision": _median_of(same, "precision") if d["prefetch"] else None,
            "recall_at_k": _median_of(same, "recall_at_k") if d["prefetch"] else None,
            "wasted_bytes_per_token": statistics.median(r.wasted_bytes / max(r.positions_scored, 1) for r in same),
        })
    return rows


def _median_of(results: Sequence[ReplayResult], name: str) -> float:
    return statistics.median(r.prefetch.get(name, math.nan) for r in results)


def replay_command(paths: Sequence[str], *, policy: str, cache_per_layer: str, scope: str, warmup: float,
                   pin_from: Sequence[str], pin_fraction: float, prefetch: str, prefetch_count: int | None,
                   each: bool, split_prefill: bool = False, half_life: float | None = None,
                   demote: bool = True) -> tuple[dict[str, Any], str]:
    """What ``python -m colibri_aio replay`` prints: a JSON document and the same as a table.

    With ``each``, every trace is replayed on its own and the document adds
    the median and min-max over traces of every configuration.
    """
    for path in [*paths, *pin_from]:
        if not os.path.isfile(path):
            raise UserError(f"{path}: no such trace file")
    traces = [load_traces([p], split_prefill) for p in paths] if each else [load_traces(paths, split_prefill)]
    predictors = traces[0].predictors
    grid: dict[str, Any] = dict(
        policies=parse_list(policy, REPLAY_POLICIES, "--policy"), sizes=parse_sizes(cache_per_layer),
        scopes=parse_list(scope, ("layer", "global"), "--scope"),
        prefetch=[None if p == "none" else p for p in parse_list(prefetch, ("none", *predictors), "--prefetch")],
        warmup=warmup, pin_fraction=pin_fraction, prefetch_count=prefetch_count, half_life=half_life,
        demote=demote, pin_from=load_traces(pin_from, split_prefill) if pin_from else None)
    per_trace = [run_grid(t, **grid) for t in traces]
    names = list(paths) if each else ["+".join(paths)]
    doc: dict[str, Any] = {"traces": list(paths), "warmup": warmup, "pin_from": list(pin_from),
                           "prefill_as_decode": split_prefill, "half_life": half_life, "demote": demote}
    if each:
        doc |= {"summary": summarise(per_trace), "per_trace": [[r.as_dict() for r in rs] for rs in per_trace]}
    else:
        doc["results"] = [r.as_dict() for r in per_trace[0]]
    text = "\n".join(f"# {name}\n{format_results(rs)}" for name, rs in zip(names, per_trace))
    return doc, text


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Declare ``replay`` and its options."""
    p = sub.add_parser("replay", help="replay route traces through the expert cache: hit rate and bytes read",
                       description="Simulate the expert cache (and lookahead prefetch) on route traces written by "
                                   "`trace`, without running the model. Lists (a,b,c) run every combination.")
    p.add_argument("traces", nargs="+", type=Path, help="trace files of one model; their runs follow one another")
    p.add_argument("--cache-per-layer", default="2", metavar="N[,N..]", help="slots per layer (default: %(default)s)")
    p.add_argument("--policy", default="lru", metavar="P[,P..]",
                   help="lru, lfu, lfru, pinned+lru, belady, or all (default: %(default)s)")
    p.add_argument("--scope", default="layer", metavar="S[,S..]",
                   help="layer: a quota of slots per layer; global: all layers share the slots (default: %(default)s)")
    p.add_argument("--warmup", type=float, default=0.25, metavar="F",
                   help="share of positions that warms the cache but is not scored (default: %(default)s)")
    p.add_argument("--pin-from", type=Path, action="append", default=[], metavar="TRACE",
                   help="pinned+lru: learn pins from these traces instead of the warm-up part")
    p.add_argument("--pin-fraction", type=float, default=0.5, metavar="F",
                   help="pinned+lru: share of the slots given to pins (default: %(default)s)")
    p.add_argument("--prefetch", default="none", metavar="PRED[,PRED..]",
                   help="replay lookahead prefetch with these predictors of the trace, none, or all")
    p.add_argument("--prefetch-count", type=int, default=None, metavar="N",
                   help="candidates prefetched per position (default: the predictor's adaptive count)")
    p.add_argument("--half-life", type=float, default=None, metavar="USES",
                   help="lfru: half-life of a key's score in cache uses (default: the slot count)")
    p.add_argument("--no-demote", action="store_true",
                   help="keep prefetches their layer did not use at their place instead of evicting them first")
    p.add_argument("--prefill-as-decode", action="store_true",
                   help="replay prompt positions one at a time, as teacher-forced decode would read them")
    p.add_argument("--each", action="store_true", help="replay each trace on its own; report median and min-max")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    p.add_argument("--plot", type=Path, default=None, metavar="FILE.png|.svg",
                   help="also draw hit rate against cache size per policy, with Belady's optimum beside them "
                        "(800x500 px; needs pip install 'colibri-aio[plot]')")
    p.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    """Print :func:`replay_command`'s table, or its JSON document with --json (and draw it with --plot); the exit
    status."""
    if args.plot is not None:
        from colibri_aio.plots import check_plot_path

        check_plot_path(args.plot, "--plot")  # before the replay, which can take a while
    options: dict[str, Any] = dict(
        cache_per_layer=args.cache_per_layer, scope=args.scope, warmup=args.warmup,
        pin_from=[str(t) for t in args.pin_from], pin_fraction=args.pin_fraction, prefetch_count=args.prefetch_count,
        each=args.each, split_prefill=args.prefill_as_decode, half_life=args.half_life, demote=not args.no_demote)
    paths = [str(t) for t in args.traces]
    doc, text = replay_command(paths, policy=args.policy, prefetch=args.prefetch, **options)
    print(json.dumps(doc, indent=1) if args.json else text)
    if args.plot is not None:
        _plot(doc, paths, options, args.plot)
    return 0


def _plot(doc: dict[str, Any], paths: list[str], options: dict[str, Any], out: Path) -> None:
    """Draw ``doc``'s rows against cache size with Belady's beside them (replayed here when the grid had none)."""
    from colibri_aio.plots import replay_figure

    key = "summary" if options["each"] else "results"
    rows = doc[key]
    belady = [r for r in rows if r["policy"] == "belady" and not r["prefetch"]]
    if not belady:  # the optimum at the same sizes and scopes, without prefetch (Belady needs none)
        belady = replay_command(paths, policy="belady", prefetch="none", **options)[0][key]
    names = ", ".join(Path(p).name for p in paths)
    replay_figure(rows, belady, out, title=f"replay of {names} (warm-up {options['warmup']:g} not scored)")
