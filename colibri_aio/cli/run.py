"""``run``: generate a continuation of a prompt, streamed to stdout, with live telemetry on stderr."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from pathlib import Path
from typing import IO, TYPE_CHECKING

from colibri_aio.cli.loop import run_loop
from colibri_aio.cli.options import (add_model, add_placement, add_prompt, add_prompt_cache, add_sampling, model_path,
                                     placement_options, prompt_text, sampling_options)
from colibri_aio.cli.outfiles import open_out
from colibri_aio.errors import UserError

if TYPE_CHECKING:
    from colibri_aio.cli.telemetry import StatusLine
    from colibri_aio.text.sampling import SamplingParams


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Declare ``run`` and its options."""
    p = sub.add_parser("run", help="generate text, streamed to stdout as it is produced",
                       description="Generate a continuation of a prompt and stream it to stdout.")
    add_model(p)
    add_prompt(p, "The list type")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=64, metavar="N",
                   help="stop after N new tokens, or earlier when the context is full (default: %(default)s)")
    add_sampling(p, "greedy: temperature 0, no filters, no penalties")
    t = p.add_argument_group("telemetry")
    t.add_argument("--stats", action=argparse.BooleanOptionalAction, default=None,
                   help="print an iostat-style table, one line per interval, on stderr (default: off; on a "
                        "terminal a one-line status is kept on the last row instead, --no-stats hides it)")
    t.add_argument("--stats-interval", type=float, default=1.0, metavar="S", help="seconds per line (default: %(default)s)")
    t.add_argument("--stats-json", type=Path, default=None, metavar="FILE", help="write the same samples as JSON lines")
    add_placement(p)
    add_prompt_cache(p)
    p.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    """Check every option before the model is opened, then generate; the exit status."""
    from colibri_aio.text.sampling import SamplingParams, check_generation_options

    prompt = prompt_text(args)
    sampling = SamplingParams().override(sampling_options(args))
    check_generation_options(max_tokens=args.max_tokens, sampling=sampling)
    if not args.stats_interval > 0:
        raise UserError(f"--stats-interval must be positive, got {args.stats_interval}")
    with contextlib.ExitStack() as files:
        json_out = files.enter_context(open_out(args.stats_json, "--stats-json")) if args.stats_json else None
        return run_loop(_run_async(args, prompt, sampling, json_out))


def _status_line() -> StatusLine | None:
    """The live one-line status, where stderr is a terminal (taking its last row if the text shares it)."""
    from colibri_aio.cli.telemetry import StatusLine

    if not sys.stderr.isatty():
        return None
    try:
        shares = sys.stdout.isatty() and os.ttyname(sys.stdout.fileno()) == os.ttyname(sys.stderr.fileno())
    except (OSError, ValueError):
        shares = False
    return StatusLine(sys.stderr, shares_screen=shares)


async def _run_async(args: argparse.Namespace, prompt: str, sampling: SamplingParams,
                     json_out: IO[str] | None) -> int:
    from colibri_aio.cli.telemetry import Telemetry, summary_line
    from colibri_aio.engine.engine import Engine

    async with await Engine.open(model_path(args), **placement_options(args)) as engine:
        print(f"[{engine.describe()}]", file=sys.stderr, flush=True)
        cache_file = args.prompt_cache
        if cache_file is not None and cache_file.exists():
            n = await engine.restore_slot(cache_file)
            print(f"[prompt cache: {n} positions restored from {cache_file}]", file=sys.stderr, flush=True)
        status = _status_line() if args.stats is None else None
        telemetry = Telemetry(engine, interval=args.stats_interval, out=sys.stderr if args.stats else None,
                              json_out=json_out, status=status)
        stop = asyncio.Event()
        last = None
        if status is not None:
            status.start()
        try:
            async with asyncio.TaskGroup() as tg:  # the decode loop and the telemetry, one owner
                if args.stats or json_out or status:
                    tg.create_task(telemetry.run(stop))
                try:
                    async for last in engine.generate(prompt, chat=args.chat, max_tokens=args.max_tokens,
                                                      stop=args.stop, sampling=sampling):
                        sys.stdout.write(last.text)
                        sys.stdout.flush()
                finally:
                    stop.set()
        finally:
            if status is not None:
                status.close()
        sys.stdout.write("\n")
        sys.stdout.flush()
        if cache_file is not None:
            await engine.save_slot(cache_file)
        print(summary_line(engine.stats(), _finish(last, args.max_tokens, engine.net.n_ctx)), file=sys.stderr)
    return 0


def _finish(last, max_tokens: int, n_ctx: int) -> str | None:
    """Why the text ended, in words; says so when the context, not --max-tokens, ended it."""
    if last is None:
        return None
    if last.finish_reason == "length" and last.generated_tokens < max_tokens:
        return (f"length (the context is full: {n_ctx} positions, {last.generated_tokens} of the {max_tokens} "
                f"tokens asked for; --ctx sets it)")
    return last.finish_reason
