"""``python -m colibri_aio``: run, chat, serve, logits, trace, trace-stats, replay, plan, doctor, iobench.

One error path for every command (:func:`main`):

- a user mistake or a broken input (:class:`UserError`, an output file that
  cannot be written) is one line on stderr and exit status 2, whichever task
  raised it (exception groups are unwrapped); so is a mistake argparse finds;
- an I/O fault while streaming an expert is one line naming file, offset and
  expert, exit status 1;
- Ctrl-C (SIGINT) and SIGTERM both stop the work the same way: reads in
  flight are drained and the usage history is saved; exit 130 and 143;
- a reader that goes away (``run ... | head``) ends the run quietly (141).

The options several commands share are in :mod:`colibri_aio.cli.options`.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, NoReturn

from colibri_aio import __version__
from colibri_aio.errors import ExpertReadError, UserError, one_line
from colibri_aio.cli import chat, logits, run, serve
from colibri_aio.cli.logs import configure as configure_logs
from colibri_aio.cli.loop import Terminated, run_loop
from colibri_aio.cli.options import (add_memory, add_model, add_placement, add_prompt, model_path,
                                     placement_options, prompt_text)
from colibri_aio.cli.outfiles import check_writable, open_out

EXIT_USER, EXIT_IO, EXIT_INTERRUPTED, EXIT_PIPE, EXIT_TERMINATED = 2, 1, 130, 141, 143


class _Parser(argparse.ArgumentParser):
    """argparse with its mistakes reported as one line, like every other mistake."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USER, f"colibri-aio: error: {self.prog.removeprefix('python -m colibri_aio ')}: {message} "
                             f"(see {self.prog} --help)\n")


def _add_trace(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace", help="record routing (experts, weights, lookahead predictions) to JSONL",
                       description="Prefill a prompt and decode, writing every layer's routing at every position "
                                   "as JSON lines (format in the README).")
    add_model(p)
    add_prompt(p, None)
    p.add_argument("--max-tokens", type=int, default=32, metavar="N", help="decode N tokens after the prompt (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="sampling temperature for decode (default: %(default)s)")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="random seed for sampling")
    p.add_argument("--out", required=True, type=Path, help="output .jsonl file")
    add_placement(p)
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
    add_model(p)
    add_memory(p)
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--measure", action=argparse.BooleanOptionalAction, default=True,
                   help="measure this machine's kernel speed for the per-token estimate (about a second, once: "
                        "it is cached) (default: on)")
    p.set_defaults(func=_plan)


def _plan(args: argparse.Namespace) -> int:
    import json

    from colibri_aio.engine.history import HistoryFile
    from colibri_aio.engine.memory import memory_limits
    from colibri_aio.engine.placement import Placement, plan_for
    from colibri_aio.engine.opening import engine_kernels, kernels_name
    from colibri_aio.engine.speed import decode_weights, machine_speed
    from colibri_aio.gguf.model import load
    from colibri_aio.models import default_model_path
    from colibri_aio.policy.budget import parse_size

    placement = Placement(ram_budget=parse_size(args.ram_budget) if args.ram_budget else None,
                          cache_per_layer=args.cache_per_layer, pin=args.pin, context=args.ctx, kv_type=args.kv_type)
    model = load(model_path(args) or default_model_path(), resident=False)
    past = HistoryFile.for_model(model).load() if args.history else None
    limits = memory_limits()
    speed = None
    if args.measure:
        kernels = engine_kernels(kernels_name(getattr(args, "kernels", None)))
        try:
            speed = machine_speed(kernels, set(decode_weights(model)))
        finally:
            kernels.close()
    plan, _ = plan_for(model, placement, past, limits, speed)
    if args.json:
        print(json.dumps({**plan.as_dict(), "model": str(model.path), "files": [str(p) for p in model.paths],
                          "file_bytes": model.file_nbytes, "ram_total": limits.total,
                          "ram_available": limits.available, "cgroup_limit": limits.cgroup_limit}, indent=1))
    else:
        print(_plan_table(model, plan, limits))
    return 0


def _sliding_note(args, context: int) -> str:
    """``"; 18 of 36 layers slide: they hold 128"``, or nothing when every layer keeps the whole context."""
    windows = [w for w in args.kv_windows() if w is not None and w < context]
    if not windows:
        return ""
    held = ", ".join(str(w) for w in sorted(set(windows)))
    return f"; {len(windows)} of {args.block_count} layers slide: they hold {held}"


def _plan_table(model, plan, limits) -> str:
    from colibri_aio.engine.plan import ASSUMED_DISK_BYTES_PER_S, gb

    a = model.args
    hit = f"n/a ({plan.hit_rate_source})" if plan.expected_hit_rate is None else \
        f"{plan.expected_hit_rate:.1%} ({plan.hit_rate_source})"
    rows = [
        ("model", f"{model.path.name}: {a.architecture}, {a.layers_text}, {a.expert_count} experts "
                  f"(top-{a.expert_used_count}) of {gb(plan.expert_nbytes)}, file {gb(model.file_nbytes)}"
                  + (f" in {len(model.paths)} parts" if len(model.paths) > 1 else "")),
        ("memory", f"RAM {gb(limits.total)}, available {gb(limits.available)}, cgroup limit "
                   f"{gb(limits.cgroup_limit) if limits.cgroup_limit else 'none'}"),
        ("budget", f"{gb(plan.budget)} ({plan.budget_source})"),
        ("trunk resident", gb(plan.trunk)),
        ("KV cache", f"{gb(plan.kv_cache)} {plan.kv_type} for {plan.context} positions ({plan.context_source})"
                     + _sliding_note(a, plan.context)),
        ("working", gb(plan.working)),
        ("expert pool", f"{plan.slots} slots x {gb(plan.slot_nbytes)} = {gb(plan.pool)} "
                        f"({plan.slots}/{plan.experts_total} experts{', all fit' if plan.all_experts_fit else ''}; "
                        f"a slot holds one expert of {gb(plan.expert_nbytes)} aligned for O_DIRECT)"),
        ("pinned", f"{plan.pinned_slots} slots = {gb(plan.pinned_slots * plan.slot_nbytes)}"),
        ("expected hit rate", hit),
        ("per token", f"compute ~{plan.compute_s_per_token * 1e3:.1f} ms, expert reads ~"
                      f"{plan.disk_s_per_token * 1e3:.1f} ms -> bound by {plan.bottleneck} "
                      f"(compute: {plan.speed_source}; reads at an assumed {ASSUMED_DISK_BYTES_PER_S / 1e9:.1f} GB/s)"),
    ] + [("note", note) for note in plan.notes]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _add_iobench(sub: argparse._SubParsersAction) -> None:
    from colibri_aio.bench.iobench import add_iobench_arguments, run_iobench

    p = sub.add_parser("iobench", help="expert-sized read benchmark per I/O backend, paired with fio when present",
                       description="Random or sequential expert-sized reads per backend: GB/s, IOPS, latency "
                                   "p50/p99, and our/fio ratios on the same file in the same run.")
    add_iobench_arguments(p)
    p.set_defaults(func=run_iobench)


def _add_doctor(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="read-only checks: model file, io_uring, O_DIRECT, memlock, memory, read speed",
                       description="Check this machine and a model (default: the shipped one); one verdict per line. "
                                   "Exit status 2 when a check fails.")
    add_model(p)
    p.add_argument("--verify", action="store_true",
                   help="also decode every tensor and fail on values that are not finite (reads the whole file)")
    p.set_defaults(func=_doctor)


def _doctor(args: argparse.Namespace) -> int:
    from colibri_aio.cli.doctor import Check, run_checks
    from colibri_aio.models import default_model_path

    def progress(done: int, total: int) -> None:
        sys.stderr.write(f"\r\033[Kverify {done / total:.0%}" + ("\r\033[K" if done >= total else ""))
        sys.stderr.flush()

    failed: list[Check] = []

    def emit(check: Check) -> None:
        print(check.line(), flush=True)
        if check.verdict == "fail":
            failed.append(check)

    status = run_checks(model_path(args) or default_model_path(), emit, verify=args.verify,
                        progress=progress if sys.stderr.isatty() else None)
    if failed:  # the verdicts are on stdout; the error path's one line on stderr, as for every command
        more = f" (and {len(failed) - 1} more failed checks)" if len(failed) > 1 else ""
        raise UserError(f"doctor: {failed[0].name}: {failed[0].detail}{more}")
    return status


def _trace(args: argparse.Namespace) -> int:
    text = prompt_text(args)
    if args.max_tokens < 0:
        raise UserError(f"--max-tokens must be >= 0, got {args.max_tokens}")
    check_writable(args.out, "--out")
    return run_loop(_trace_async(args, text))


async def _trace_async(args: argparse.Namespace, text: str) -> int:
    from colibri_aio.cli.route_trace import TraceRecorder, trace_run
    from colibri_aio.engine.engine import Engine
    from colibri_aio.text.sampling import make_sampler

    sample = make_sampler(temperature=args.temperature, seed=args.seed)
    async with await Engine.open(model_path(args), **placement_options(args)) as engine:
        ids = engine.prompt_ids(text)
        if len(ids) >= engine.net.n_ctx:
            raise UserError(f"the prompt has {len(ids)} tokens; the context holds {engine.net.n_ctx}")
        with open_out(args.out, "--out") as out:
            recorder = TraceRecorder(engine.model, out)
            recorder.header()
            async with engine.turn():
                new = await trace_run(engine.net, recorder, 0, ids, args.max_tokens, sample,
                                      engine.tokenizer.is_eog)
    print(f"traced {len(ids)} prompt + {len(new)} decoded positions x {engine.model.args.block_count} layers "
          f"-> {args.out}", file=sys.stderr)
    return 0


def _trace_stats(args: argparse.Namespace) -> int:
    import json

    from colibri_aio.cli.route_stats import compute, format_table
    from colibri_aio.cli.route_trace import read_trace

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

    from colibri_aio.cli.replay import replay_command

    doc, text = replay_command(
        [str(t) for t in args.traces], policy=args.policy, cache_per_layer=args.cache_per_layer,
        scope=args.scope, warmup=args.warmup, pin_from=[str(t) for t in args.pin_from],
        pin_fraction=args.pin_fraction, prefetch=args.prefetch, prefetch_count=args.prefetch_count, each=args.each,
        split_prefill=args.prefill_as_decode, half_life=args.half_life, demote=not args.no_demote)
    print(json.dumps(doc, indent=1) if args.json else text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m colibri_aio",
        description="Run Mixture-of-Experts models larger than RAM, straight from GGUF files.")
    parser.add_argument("--version", action="version", version=f"colibri-aio {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine events (backend choice, placement)")
    parser.add_argument("--log-json", action="store_true", help="write logs to stderr as JSON lines")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (run.add_parser, chat.add_parser, serve.add_parser, logits.add_parser, _add_trace, _add_trace_stats,
                _add_replay, _add_plan, _add_doctor, _add_iobench):
        add(sub)
    return parser


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    """The exceptions inside (nested) exception groups, in order; ``exc`` itself if it is not a group."""
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


def _first(exc: BaseException, kind: type[BaseException] | tuple[type[BaseException], ...]) -> BaseException | None:
    return next((e for e in _leaves(exc) if isinstance(e, kind)), None)


def _silence_stdout() -> None:
    """After a broken pipe: point stdout at /dev/null, so the flush at exit does not complain again."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def exit_status(exc: BaseException, err: IO[str]) -> int:
    """The exit status for ``exc`` (after one line on ``err`` where one is due); re-raises a bug."""
    if _first(exc, Terminated):
        return EXIT_TERMINATED
    if _first(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if _first(exc, BrokenPipeError):
        _silence_stdout()
        return EXIT_PIPE
    if (found := _first(exc, UserError)) is not None:
        print(f"colibri-aio: error: {one_line(found)}", file=err)
        return EXIT_USER
    if (found := _first(exc, ExpertReadError)) is not None:
        print(f"colibri-aio: I/O error: {one_line(found)}", file=err)
        return EXIT_IO
    found = _first(exc, OSError)
    if isinstance(found, OSError) and found.filename is not None:  # a file the user named or a place to write
        print(f"colibri-aio: error: {one_line(f'{found.filename}: {found.strerror or found}')}", file=err)
        return EXIT_USER
    if isinstance(found, OSError) and found.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        # Standard output on a full disk: the text the run wrote there is lost, and the interpreter's own flush
        # at exit would fail again (a second report), so stdout goes to /dev/null first.
        _silence_stdout()
        print(f"colibri-aio: error: cannot write the output ({found.strerror})", file=err)
        return EXIT_USER
    raise exc


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


@contextlib.contextmanager
def _sigterm_as_exception() -> Iterator[None]:
    """Outside the event loop, SIGTERM raises :class:`Terminated` (like SIGINT raises KeyboardInterrupt)."""
    try:
        before = signal.signal(signal.SIGTERM, _raise_terminated)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (see the module's docstring)."""
    with _sigterm_as_exception():
        try:
            args = build_parser().parse_args(argv)
            configure_logs(verbose=args.verbose, json=args.log_json)
            func: Callable[[argparse.Namespace], int] = args.func
            return func(args)
        except SystemExit:
            raise
        except BaseException as exc:  # noqa: BLE001 - sorted by exit_status, bugs re-raised
            return exit_status(exc, sys.stderr)
