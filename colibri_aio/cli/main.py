"""``python -m colibri_aio``: run, logits, iobench.

A user mistake or a broken file is one line on stderr and exit status 2; an
I/O fault is one line naming file, offset and expert, exit status 1.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from colibri_aio import __version__
from colibri_aio.errors import ExpertReadError, UserError
from colibri_aio.cli.logs import configure as configure_logs
from colibri_aio.engine.placement import IO_CHOICES, PREFETCH_CHOICES
from colibri_aio.kernels.backend import NAMES as KERNEL_NAMES


def _add_placement(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("placement (changes speed, never tokens)")
    g.add_argument("--io", choices=IO_CHOICES, default="auto",
                   help="how expert bytes are read: io_uring with O_DIRECT, a thread-pool pread, or mmap "
                        "(auto: io_uring, else pread; default: %(default)s)")
    g.add_argument("--ram-budget", default=None, metavar="SIZE",
                   help="memory for trunk + KV cache + expert cache, e.g. 512M, 12G, 1.5GiB "
                        "(default: 85%% of usable RAM, cgroup limit included)")
    g.add_argument("--cache-per-layer", type=int, default=None, metavar="N",
                   help="hold N experts per layer instead of sizing the cache from the budget")
    g.add_argument("--prefetch", choices=PREFETCH_CHOICES, default="auto",
                   help="read the experts router lookahead predicts for the next layer; auto keeps it on "
                        "unless the disk is saturated and decode steps measure faster with it off "
                        "(default: %(default)s)")
    g.add_argument("--pin", default="off", metavar="auto|off|FILE",
                   help="keep the most used experts (from a usage history) resident (default: %(default)s)")
    g.add_argument("--kernels", choices=KERNEL_NAMES, default=None,
                   help="matrix kernels: ggml (llama.cpp's CPU kernels, activations rounded to 8 bits as "
                        "llama.cpp does) or numpy (the float32 reference); auto picks ggml when it loads "
                        "(default: $COLIBRI_KERNELS or auto)")
    g.add_argument("--ctx", type=int, default=None, metavar="N",
                   help="context positions to allocate in the KV cache (default: the model's context_length)")


def _placement(args: argparse.Namespace) -> dict:
    return dict(io=args.io, ram_budget=args.ram_budget, cache_per_layer=args.cache_per_layer,
                prefetch=args.prefetch, pin=args.pin, kernels=args.kernels,
                progress=_progress if sys.stderr.isatty() else None)


def _progress(step: str, done: int, total: int) -> None:
    """A one-line progress display on the terminal: rewritten in place, ended when the step is done."""
    sys.stderr.write(f"\r\033[K{step} {done}/{total}" + ("\n" if done >= total else ""))
    sys.stderr.flush()


def _add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="generate text, streamed to stdout as it is produced",
                       description="Generate a continuation of a prompt and stream it to stdout.")
    p.add_argument("--model", type=Path, default=None, help="GGUF file (default: the small model shipped in the package)")
    p.add_argument("--prompt", default="The list type", help="prompt text (default: %(default)r)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=64, metavar="N", help="stop after N new tokens (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 picks the most likely token (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="sample from the K most likely tokens; 0 = all (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass; 1 = off (default: %(default)s)")
    p.add_argument("--min-p", type=float, default=0.0, metavar="P", help="drop tokens below P x the top probability; 0 = off (default: %(default)s)")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="random seed: the same seed gives the same text")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop when TEXT is produced (repeatable)")
    t = p.add_argument_group("telemetry")
    t.add_argument("--stats", action=argparse.BooleanOptionalAction, default=None,
                   help="print an iostat-style line per interval on stderr (default: on when stderr is a terminal)")
    t.add_argument("--stats-interval", type=float, default=1.0, metavar="S", help="seconds per line (default: %(default)s)")
    t.add_argument("--stats-json", type=Path, default=None, metavar="FILE", help="write the same samples as JSON lines")
    _add_placement(p)
    p.set_defaults(func=_run)


def _add_logits(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("logits", help="write teacher-forced logits of token ids to a .npy file",
                       description="Write float32 logits of shape (len(ids), vocab); row i follows ids[0..i].")
    p.add_argument("model", type=Path, help="GGUF file")
    p.add_argument("--ids", required=True, help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--out", required=True, type=Path, help="output .npy file")
    _add_placement(p)
    p.set_defaults(func=_logits)


def _add_trace(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace", help="record routing (experts, weights, lookahead predictions) to JSONL",
                       description="Prefill a prompt and decode, writing every layer's routing at every position "
                                   "as JSON lines (format in the README).")
    p.add_argument("model", type=Path, help="GGUF file")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", type=Path, help="read the prompt from a UTF-8 file")
    p.add_argument("--max-tokens", type=int, default=32, metavar="N", help="decode N tokens after the prompt (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="sampling temperature for decode (default: %(default)s)")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="random seed for sampling")
    p.add_argument("--out", required=True, type=Path, help="output .jsonl file")
    _add_placement(p)
    p.set_defaults(func=_trace)


def _add_trace_stats(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace-stats", help="routing statistics of a trace: skew, locality, lookahead recall",
                       description="Per layer: expert-use entropy, top-10%% share, breadth, locality; per lookahead "
                                   "predictor: recall and precision of the next layer's top-k.")
    p.add_argument("trace", type=Path, help="a file written by `trace`")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    p.set_defaults(func=_trace_stats)


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="how a model would be placed in memory, and whether it fits",
                       description="Print the placement for MODEL: trunk, KV cache, expert pool, pins, expected "
                                   "hit rate and bottleneck, from the GGUF's sizes, available RAM and the cgroup "
                                   "memory limit. Exit status 2 when the budget cannot hold it.")
    p.add_argument("model", type=Path, help="GGUF file")
    p.add_argument("--ram-budget", default=None, metavar="SIZE", help="e.g. 12G (default: 85%% of usable RAM)")
    p.add_argument("--context", type=int, default=None, metavar="N", help="KV-cache positions (default: context_length)")
    p.add_argument("--pin", default="off", metavar="auto|off|FILE", help="plan pins from a usage history")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(func=_plan)


def _plan(args: argparse.Namespace) -> int:
    import json

    from colibri_aio.gguf.model import load
    from colibri_aio.engine.memory import memory_limits
    from colibri_aio.engine.plan import make_plan
    from colibri_aio.policy.budget import parse_size
    from colibri_aio.engine.placement import PIN_SHARE, usage_history

    model = load(args.model, resident=False)
    history = usage_history(model)
    counts = {(l, e): float(c) for (l, e), c in np.ndenumerate(history.counts) if c > 0} or None
    limits = memory_limits()
    plan = make_plan(model, limits, budget=parse_size(args.ram_budget) if args.ram_budget else None,
                     context=args.context, usage_counts=counts, pin_share=PIN_SHARE if args.pin != "off" else 0.0)
    if args.json:
        print(json.dumps({**plan.as_dict(), "model": str(model.path), "ram_total": limits.total,
                          "ram_available": limits.available, "cgroup_limit": limits.cgroup_limit}, indent=1))
    else:
        print(_plan_table(model, plan, limits))
    return 0


def _plan_table(model, plan, limits) -> str:
    from colibri_aio.engine.plan import gb

    a = model.args
    hit = "n/a (no usage history)" if plan.expected_hit_rate is None else \
        f"{plan.expected_hit_rate:.1%} ({plan.hit_rate_source})"
    rows = [
        ("model", f"{model.path.name}: {a.architecture}, {a.block_count} layers, {a.expert_count} experts "
                  f"(top-{a.expert_used_count}), file {gb(model.identity.size)}"),
        ("memory", f"RAM {gb(limits.total)}, available {gb(limits.available)}, cgroup limit "
                   f"{gb(limits.cgroup_limit) if limits.cgroup_limit else 'none'}"),
        ("budget", f"{gb(plan.budget)} ({plan.budget_source})"),
        ("trunk resident", gb(plan.trunk)),
        ("KV cache", f"{gb(plan.kv_cache)} for {plan.context} positions"),
        ("working", gb(plan.working)),
        ("expert pool", f"{plan.slots} slots x {gb(plan.slot_nbytes)} = {gb(plan.pool)} "
                        f"({plan.slots}/{plan.experts_total} experts{', all fit' if plan.all_experts_fit else ''})"),
        ("pinned", f"{plan.pinned_slots} slots = {gb(plan.pinned_slots * plan.slot_nbytes)}"),
        ("expected hit rate", hit),
        ("per token", f"compute ~{plan.compute_s_per_token * 1e3:.1f} ms, expert reads ~"
                      f"{plan.disk_s_per_token * 1e3:.1f} ms -> bound by {plan.bottleneck}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _add_iobench(sub: argparse._SubParsersAction) -> None:
    from colibri_aio.cli.iobench import add_iobench_arguments, run_iobench

    p = sub.add_parser("iobench", help="expert-sized read benchmark per I/O backend, paired with fio when present",
                       description="Random or sequential expert-sized reads per backend: GB/s, IOPS, latency "
                                   "p50/p99, and our/fio ratios on the same file in the same run.")
    add_iobench_arguments(p)
    p.set_defaults(func=run_iobench)


def _add_doctor(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="read-only checks: model file, io_uring, O_DIRECT, memlock, memory, read speed",
                       description="Check this machine and a model (default: the shipped one); one verdict per line.")
    p.add_argument("model", type=Path, nargs="?", default=None, help="GGUF file")
    p.set_defaults(func=_doctor)


def _doctor(args: argparse.Namespace) -> int:
    from colibri_aio.cli.doctor import run_checks
    from colibri_aio.models import default_model_path

    return run_checks(args.model or default_model_path(), lambda c: print(c.line(), flush=True))


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise UserError(f"--ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise UserError("--ids is empty")
    return ids


async def _run_async(args: argparse.Namespace) -> int:
    from colibri_aio.engine.engine import Engine
    from colibri_aio.cli.telemetry import Telemetry, summary_line

    show = sys.stderr.isatty() if args.stats is None else args.stats
    if args.stats_interval <= 0:
        raise UserError("--stats-interval must be positive")
    async with await Engine.open(args.model, n_ctx=args.ctx, **_placement(args)) as engine:
        print(f"[{engine.describe()}]", file=sys.stderr)
        with contextlib.ExitStack() as files:
            json_out = files.enter_context(_open_out(args.stats_json)) if args.stats_json else None
            telemetry = Telemetry(engine, interval=args.stats_interval, out=sys.stderr if show else None,
                                  json_out=json_out)
            stop = asyncio.Event()
            async with asyncio.TaskGroup() as tg:  # the decode loop and the telemetry, one owner
                if show or json_out:
                    tg.create_task(telemetry.run(stop))
                try:
                    async for piece in engine.generate(
                            args.prompt, chat=args.chat, max_tokens=args.max_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed, stop=args.stop):
                        sys.stdout.write(piece.text)
                        sys.stdout.flush()
                finally:
                    stop.set()
        sys.stdout.write("\n")
        print(summary_line(engine.stats()), file=sys.stderr)
    return 0


def _open_out(path: Path):
    try:
        return open(path, "w", encoding="utf-8")
    except OSError as exc:
        raise UserError(f"{path}: cannot write ({exc.strerror})") from None


def _run(args: argparse.Namespace) -> int:
    return _run_loop(_run_async(args))


async def _logits_async(args: argparse.Namespace) -> int:
    from colibri_aio.engine.engine import Engine

    ids = _parse_ids(args.ids)
    async with await Engine.open(args.model, n_ctx=args.ctx or len(ids), **_placement(args)) as engine:
        if max(ids) >= engine.model.args.vocab_size or min(ids) < 0:
            raise UserError(f"--ids: every id must be in [0, {engine.model.args.vocab_size})")
        out = await engine.logits(ids)
    np.save(args.out, out.astype(np.float32, copy=False))
    return 0


def _logits(args: argparse.Namespace) -> int:
    return _run_loop(_logits_async(args))


async def _trace_async(args: argparse.Namespace) -> int:
    from colibri_aio.engine.engine import Engine
    from colibri_aio.text.sampling import make_sampler
    from colibri_aio.cli.trace import TraceRecorder, trace_run

    text = args.prompt if args.prompt is not None else _read_text(args.prompt_file)
    async with await Engine.open(args.model, n_ctx=args.ctx, **_placement(args)) as engine:
        ids = engine.prompt_ids(text)
        if len(ids) >= engine.net.n_ctx:
            raise UserError(f"the prompt has {len(ids)} tokens; the context holds {engine.net.n_ctx}")
        with open(args.out, "w", encoding="utf-8") as f:
            recorder = TraceRecorder(engine.model, f)
            recorder.header()
            sample = make_sampler(temperature=args.temperature, seed=args.seed)
            new = await trace_run(engine.net, recorder, 0, ids, args.max_tokens, sample, engine.tokenizer.is_eog)
    print(f"traced {len(ids)} prompt + {len(new)} decoded positions x {engine.model.args.block_count} layers "
          f"-> {args.out}", file=sys.stderr)
    return 0


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read prompt file ({exc.__class__.__name__})") from None


def _trace(args: argparse.Namespace) -> int:
    return _run_loop(_trace_async(args))


def _trace_stats(args: argparse.Namespace) -> int:
    import json

    from colibri_aio.cli.route_stats import compute, format_table
    from colibri_aio.cli.trace import read_trace

    if not args.trace.is_file():
        raise UserError(f"{args.trace}: no such trace file")
    stats = compute(read_trace(str(args.trace)))
    print(json.dumps(stats.as_dict(), indent=1) if args.json else format_table(stats))
    return 0


def _add_replay(sub: argparse._SubParsersAction) -> None:
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
    p.set_defaults(func=_replay)


def _replay(args: argparse.Namespace) -> int:
    import json

    from colibri_aio.policy.replay import replay_command

    doc, text = replay_command(
        [str(t) for t in args.traces], policy=args.policy, cache_per_layer=args.cache_per_layer,
        scope=args.scope, warmup=args.warmup, pin_from=[str(t) for t in args.pin_from],
        pin_fraction=args.pin_fraction, prefetch=args.prefetch, prefetch_count=args.prefetch_count, each=args.each,
        split_prefill=args.prefill_as_decode, half_life=args.half_life, demote=not args.no_demote)
    print(json.dumps(doc, indent=1) if args.json else text)
    return 0


def _run_loop(coro) -> int:
    """Run on uvloop where it is installed (it is on Linux and macOS), else asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m colibri_aio",
        description="Run Mixture-of-Experts models larger than RAM, straight from GGUF files.")
    parser.add_argument("--version", action="version", version=f"colibri-aio {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine events (backend choice, placement)")
    parser.add_argument("--log-json", action="store_true", help="write logs to stderr as JSON lines")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_run, _add_logits, _add_trace, _add_trace_stats, _add_replay, _add_plan, _add_doctor, _add_iobench):
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    args = build_parser().parse_args(argv)
    configure_logs(verbose=args.verbose, json=args.log_json)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except UserError as exc:
        print(f"colibri-aio: error: {exc}", file=sys.stderr)
        return 2
    except ExpertReadError as exc:
        print(f"colibri-aio: I/O error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
