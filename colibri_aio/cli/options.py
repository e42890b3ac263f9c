"""Options several commands share, each as an ``add_*`` that declares it and a reader that checks it.

Options mean the same in every command: the model is a positional argument
or ``--model``; the context is ``--ctx`` or ``--context``.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from colibri_aio.arch.kvcache import DEFAULT_KV_TYPE, KV_TYPES
from colibri_aio.engine.placement import IO_CHOICES, PREFETCH_CHOICES
from colibri_aio.errors import UserError
from colibri_aio.kernels.backend import NAMES as KERNEL_NAMES


def add_model(p: argparse.ArgumentParser) -> None:
    """The model, positional or as ``--model`` (read back with :func:`model_path`)."""
    p.add_argument("model", type=Path, nargs="?", default=None,
                   help="GGUF file, here or as --model (default: the small model shipped in the package)")
    p.add_argument("--model", dest="model_option", type=Path, default=None, metavar="MODEL",
                   help="the same as the positional MODEL")


def model_path(args: argparse.Namespace) -> Path | None:
    """The model named positionally or with --model (None: the shipped one)."""
    if args.model is not None and args.model_option is not None and args.model != args.model_option:
        raise UserError(f"two models given ({args.model} and --model {args.model_option}): give one")
    return args.model if args.model is not None else args.model_option


def add_memory(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The memory options (budget, cache, pins, context, KV type, history): all that ``plan`` needs."""
    g = p.add_argument_group("placement (changes speed, never tokens)")
    g.add_argument("--ram-budget", default=None, metavar="SIZE",
                   help="memory for trunk + KV cache + expert cache, e.g. 512M, 12G, 1.5GiB "
                        "(default: 85%% of usable RAM, cgroup limit included; more than RAM or the cgroup "
                        "limit is refused)")
    g.add_argument("--cache-per-layer", type=int, default=None, metavar="N",
                   help="hold N experts per layer instead of sizing the cache from the budget")
    g.add_argument("--pin", default="off", metavar="auto|off|FILE",
                   help="keep the most used experts (from a usage history) resident (default: %(default)s)")
    g.add_argument("--ctx", "--context", dest="ctx", type=int, default=None, metavar="N",
                   help="context positions to allocate in the KV cache (default: the model's context_length, "
                        "at most 4096; more than the model's is clamped, with a warning)")
    g.add_argument("--kv-type", choices=tuple(KV_TYPES), default=DEFAULT_KV_TYPE,
                   help="how the KV cache stores keys and values: f16 halves its memory (as llama.cpp), f32 "
                        "keeps every bit (default: %(default)s)")
    g.add_argument("--parallel", type=int, default=1, metavar="N",
                   help="sequences held at once, each with its own KV cache of --ctx positions: up to N requests "
                        "decode together, each step reading every layer's experts once for all of them "
                        "(default: %(default)s)")
    g.add_argument("--history", action=argparse.BooleanOptionalAction, default=True,
                   help="read and update this model's usage history, a cache file under "
                        "$XDG_CACHE_HOME/colibri_aio/usage (default: on)")
    return g


def add_placement(p: argparse.ArgumentParser) -> None:
    """The memory options plus how the engine reads and computes (read back with :func:`placement_options`)."""
    g = add_memory(p)
    g.add_argument("--io", choices=IO_CHOICES, default="auto",
                   help="how expert bytes are read: io_uring with O_DIRECT, a thread-pool pread, or mmap "
                        "(auto: io_uring, else pread; default: %(default)s)")
    g.add_argument("--prefetch", choices=PREFETCH_CHOICES, default="auto",
                   help="read the experts router lookahead predicts for the next layer; auto keeps it on "
                        "unless the disk is saturated and decode steps measure faster with it off "
                        "(default: %(default)s)")
    g.add_argument("--warm-start", action=argparse.BooleanOptionalAction, default=True,
                   help="stream experts into the expert cache in the background, from when the trunk is read, "
                        "never during a prompt, behind every read the model waits for: all of them when they "
                        "fit, else the ones a long usage history uses most (default: on; `plan` says which)")
    g.add_argument("--read-ahead", action=argparse.BooleanOptionalAction, default=True,
                   help="while a prompt's layer computes, read the experts the next layer will likely use, with "
                        "reads issued from io_uring's kernel workers (default: on; on the 48-layer file it cut the "
                        "time to first token by a quarter)")
    g.add_argument("--kernels", choices=KERNEL_NAMES, default=None,
                   help="matrix kernels: ggml (llama.cpp's CPU kernels, activations rounded to 8 bits as "
                        "llama.cpp does) or numpy (the float32 reference); auto picks ggml when it loads "
                        "(default: $COLIBRI_KERNELS or auto)")


def add_prompt_cache(p: argparse.ArgumentParser) -> None:
    """``--prompt-cache FILE``: the KV cache restored from FILE at the start and saved to it at the end."""
    p.add_argument("--prompt-cache", type=Path, default=None, metavar="FILE",
                   help="restore the KV cache (and its token ids) from FILE when it exists, and save it there at "
                        "the end, so that a prompt beginning with the same tokens prefills only the rest next time "
                        "(a file of another model, --ctx or --kv-type is refused)")


def placement_options(args: argparse.Namespace) -> dict:
    """Engine.open's keyword arguments from the placement options."""
    return dict(io=args.io, ram_budget=args.ram_budget, cache_per_layer=args.cache_per_layer,
                prefetch=args.prefetch, pin=args.pin, kernels=args.kernels, n_ctx=args.ctx, kv_type=args.kv_type,
                history=args.history, warm_start=args.warm_start, read_ahead=args.read_ahead, parallel=args.parallel,
                progress=_progress if sys.stderr.isatty() else None)


def _progress(step: str, done: int, total: int) -> None:
    """A one-line progress display on the terminal: rewritten in place, ended when the step is done."""
    sys.stderr.write(f"\r\033[K{step} {done}/{total}" + ("\n" if done >= total else ""))
    sys.stderr.flush()


def add_prompt(p: argparse.ArgumentParser, default: str | None) -> None:
    """``--prompt`` or ``--prompt-file``; one of them is required where there is no ``default``."""
    src = p.add_mutually_exclusive_group(required=default is None)
    src.add_argument("--prompt", default=default,
                     help="prompt text" + (f" (default: {default!r})" if default is not None else ""))
    src.add_argument("--prompt-file", type=Path, default=None, metavar="FILE",
                     help="read the prompt from a UTF-8 file (- reads standard input)")


def prompt_text(args: argparse.Namespace) -> str:
    """The prompt text from --prompt or --prompt-file, checked to be UTF-8."""
    if args.prompt_file is None:
        text, where = args.prompt, "--prompt"
    else:
        where = f"--prompt-file {args.prompt_file}"
        try:
            data = sys.stdin.buffer.read() if str(args.prompt_file) == "-" else args.prompt_file.read_bytes()
            text = data.decode("utf-8")
        except OSError as exc:
            raise UserError(f"{where}: cannot read ({exc.strerror or exc})") from None
        except UnicodeDecodeError as exc:
            raise UserError(f"{where}: not UTF-8 text (byte {exc.start})") from None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # argv bytes that were not UTF-8 arrive as lone surrogates
        raise UserError(f"{where}: not UTF-8 text (at character {exc.start})") from None
    if not text:
        raise UserError(f"{where}: the prompt is empty")
    return text


def add_sampling(p: argparse.ArgumentParser, defaults: str) -> None:
    """The sampling options of run and chat (the API takes the same ones)."""
    g = p.add_argument_group("sampling", f"Options left out take their defaults ({defaults}).")
    g.add_argument("--temperature", type=float, default=None, metavar="T", help="0 picks the most likely token")
    g.add_argument("--top-k", type=int, default=None, metavar="K", help="sample from the K most likely tokens; 0 = all")
    g.add_argument("--top-p", type=float, default=None, metavar="P", help="nucleus sampling mass; 1 = off")
    g.add_argument("--min-p", type=float, default=None, metavar="P", help="drop tokens below P x the top probability; 0 = off")
    g.add_argument("--seed", type=int, default=None, metavar="S", help="random seed: the same seed gives the same text")
    g.add_argument("--repeat-penalty", type=float, default=None, metavar="R",
                   help="divide the logit of each recent token by R (llama.cpp); 1 = off")
    g.add_argument("--presence-penalty", type=float, default=None, metavar="P",
                   help="subtract P from the logit of each recent token (OpenAI); 0 = off")
    g.add_argument("--frequency-penalty", type=float, default=None, metavar="F",
                   help="subtract F x its count from the logit of each recent token (OpenAI); 0 = off")
    g.add_argument("--repeat-last-n", type=int, default=None, metavar="N",
                   help="how many recent tokens the penalties see; -1 = the whole context (default: 64)")
    g.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS to the logit of token ID (repeatable)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop when TEXT is produced (repeatable)")


def sampling_options(args: argparse.Namespace) -> dict:
    """The sampling options given on the command line (None: not given), as SamplingParams fields."""
    return dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed,
                repeat_penalty=args.repeat_penalty, presence_penalty=args.presence_penalty,
                frequency_penalty=args.frequency_penalty, penalty_last_n=args.repeat_last_n,
                logit_bias=_parse_logit_bias(args.logit_bias) or None)


def _parse_logit_bias(items: Sequence[str]) -> dict[int, float]:
    bias = {}
    for item in items:
        token, sep, value = item.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise UserError(f"--logit-bias takes ID=BIAS, e.g. 42=-5, got {item!r}") from None
        if not sep:
            raise UserError(f"--logit-bias takes ID=BIAS, e.g. 42=-5, got {item!r}")
    return bias
