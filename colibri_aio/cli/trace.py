"""``trace``: prefill a prompt and decode, writing every layer's routing at every position to a JSON-lines file
(the format, the recorder and the reader are :mod:`colibri_aio.cli.route_trace`'s)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from colibri_aio.cli.loop import run_loop
from colibri_aio.cli.options import add_model, add_placement, add_prompt, model_path, placement_options, prompt_text
from colibri_aio.cli.outfiles import check_writable, open_out
from colibri_aio.errors import UserError


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Declare ``trace`` and its options."""
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
    p.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    """Check the prompt and the output file, then record the trace; the exit status."""
    text = prompt_text(args)
    if args.max_tokens < 0:
        raise UserError(f"--max-tokens must be >= 0, got {args.max_tokens}")
    check_writable(args.out, "--out")
    return run_loop(_trace_async(args, text))


async def _trace_async(args: argparse.Namespace, text: str) -> int:
    from colibri_aio.cli.route_trace import TraceRecorder, trace_run
    from colibri_aio.engine.engine import Engine
    from colibri_aio.text.sampling import make_sampler

    if args.parallel != 1:
        raise UserError("trace follows one sequence: --parallel does not apply to it")
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
