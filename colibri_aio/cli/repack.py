"""``repack``: write a model's routed experts once in ggml's repacked layout, for ``COLIBRI_GGML_REPACK_EXPERTS``.

An engine that finds the file this writes reads its experts from it, already
repacked (unless ``COLIBRI_GGML_REPACK_EXPERTS=off``), instead of the model's
own layout or repacking each one as it lands (:mod:`colibri_aio.engine.repacked_file` says where it lives and what its
name depends on).
"""
from __future__ import annotations

import argparse
import sys

from colibri_aio.cli.options import add_model, model_path
from colibri_aio.errors import UserError


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Declare ``repack`` and its options."""
    p = sub.add_parser("repack", help="write the routed experts once in ggml's repacked layout",
                       description="Write a copy of the model's routed experts in ggml's repacked (CPU_REPACK) "
                                   "layout to the cache folder, at the GGUF's offsets (a sparse file as large as "
                                   "the model that holds only the experts). Runs read their experts from it, "
                                   "repacked, unless COLIBRI_GGML_REPACK_EXPERTS=off.")
    add_model(p)
    p.add_argument("--all", action="store_true",
                   help="repack Q4_K and Q2_K experts too (for COLIBRI_GGML_REPACK_EXPERTS=all)")
    p.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    """Write the file (or say it is there already); the exit status."""
    from colibri_aio.engine.plan import gb
    from colibri_aio.engine.repacked_file import find, write
    from colibri_aio.gguf.model import load
    from colibri_aio.kernels.backend import KernelsUnavailable, open_kernels
    from colibri_aio.models import default_model_path
    from colibri_aio.settings import Settings

    mode = "all" if args.all else "on"
    try:
        kernels = open_kernels("ggml", settings=Settings.read(ggml_repack_experts=mode))
    except KernelsUnavailable as e:
        raise UserError(f"repack needs the ggml kernels: {e}") from None
    try:
        packer = kernels.expert_packer()
    finally:
        kernels.close()
    model = load(model_path(args) or default_model_path(), resident=False)
    types = sorted({r.ggml_type.name for layer in model.experts for loc in layer for r in loc.ranges})
    if packer is None or not any(packer.packs(r.ggml_type, r.shape[0])  # type: ignore[attr-defined]
                                 for layer in model.experts for loc in layer[:1] for r in loc.ranges):
        raise UserError(f"{model.path}: no routed expert of it is repacked on this CPU (experts {', '.join(types)}; "
                        f"repacked: {', '.join(sorted(t.name for t in packer.types)) if packer else 'none'}"
                        f"{'' if args.all else '; --all adds Q4_K and Q2_K'})")
    found = find(model, packer)
    if found is not None:
        print(f"{model.path.name}: repacked experts already at {found[0]}", file=sys.stderr)
        return 0

    def progress(done: int, total: int) -> None:
        if done == total or done % max(total // 20, 1) == 0:
            print(f"\rrepack {done}/{total} experts", end="" if done < total else "\n", file=sys.stderr, flush=True)

    paths = write(model, packer, progress)
    nbytes = sum(loc.nbytes for layer in model.experts for loc in layer)
    print(f"{model.path.name}: {gb(nbytes)} of experts repacked to {paths[0]}"
          f"{f' (+{len(paths) - 1} parts)' if len(paths) > 1 else ''}", file=sys.stderr)
    return 0
