"""``logits``: teacher-forced logits of given token ids, written to a ``.npy`` file (what the oracle tests
compare)."""
from __future__ import annotations

import argparse
from pathlib import Path

from colibri_aio.cli.loop import run_loop
from colibri_aio.cli.options import add_model, add_placement, model_path, placement_options
from colibri_aio.cli.outfiles import check_writable
from colibri_aio.errors import UserError


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Declare ``logits`` and its options."""
    p = sub.add_parser("logits", help="write teacher-forced logits of token ids to a .npy file",
                       description="Write float32 logits of shape (len(ids), vocab); row i follows ids[0..i].")
    add_model(p)
    p.add_argument("--ids", required=True, help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--out", required=True, type=Path, help="output .npy file")
    add_placement(p)
    p.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    """Check the ids and the output file, then compute and write the logits; the exit status."""
    ids = _parse_ids(args.ids)
    check_writable(args.out, "--out")
    return run_loop(_logits_async(args, ids))


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise UserError(f"--ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise UserError("--ids is empty")
    return ids


async def _logits_async(args: argparse.Namespace, ids: list[int]) -> int:
    import numpy as np

    from colibri_aio.engine.engine import Engine

    placement = {**placement_options(args), "n_ctx": args.ctx or len(ids)}
    async with await Engine.open(model_path(args), **placement) as engine:
        if max(ids) >= engine.model.args.vocab_size or min(ids) < 0:
            raise UserError(f"--ids: every id must be in [0, {engine.model.args.vocab_size})")
        out = await engine.logits(ids)
    np.save(args.out, out.astype(np.float32, copy=False))
    return 0
