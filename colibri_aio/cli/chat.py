"""``chat``: the command-line side of the terminal chat of :mod:`colibri_aio.serve.chat`."""
from __future__ import annotations

import argparse

from colibri_aio.cli.options import (add_model, add_placement, add_prompt_cache, add_sampling, model_path,
                                     placement_options, sampling_options)
from colibri_aio.errors import UserError


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Declare ``chat`` and its options."""
    p = sub.add_parser("chat", help="talk with a model in the terminal (history, KV-cache reuse, /reset)",
                       description="An interactive chat: each reply streams to stdout; the KV cache keeps the "
                                   "conversation, so a turn prefills only the new message. /reset starts over, "
                                   "/exit or Ctrl-D quits, Ctrl-C stops a reply.")
    add_model(p)
    p.add_argument("--system", default=None, metavar="TEXT", help="a system message that starts the conversation")
    p.add_argument("--max-tokens", type=int, default=256, metavar="N", help="longest reply in tokens (default: %(default)s)")
    add_sampling(p, "the model's general.sampling.* keys, else llama.cpp's")
    add_placement(p)
    add_prompt_cache(p)
    p.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    """Talk until the user quits; the exit status."""
    from colibri_aio.serve.chat import chat

    if args.stop:
        raise UserError("chat takes no --stop (the model's end-of-turn token ends a reply)")
    return chat(model_path(args), system=args.system, max_tokens=args.max_tokens, sampling=sampling_options(args),
                open_options=placement_options(args), prompt_cache=args.prompt_cache)
