"""``plan``: how a model would be placed in memory and whether it fits, from the file's sizes and this machine's
memory, without opening the engine."""
from __future__ import annotations

import argparse

from colibri_aio.cli.options import add_memory, add_model, model_path


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Declare ``plan`` and its options."""
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
    p.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    """Print the plan as a table or one JSON document; the exit status."""
    import json

    from colibri_aio.engine.history import HistoryFile
    from colibri_aio.engine.memory import memory_limits
    from colibri_aio.engine.placement import Placement, plan_for
    from colibri_aio.engine.opening import engine_kernels, kernels_name
    from colibri_aio.engine.speed import decode_weights
    from colibri_aio.engine.speed_probe import machine_speed
    from colibri_aio.settings import Settings
    from colibri_aio.gguf.model import load
    from colibri_aio.models import default_model_path
    from colibri_aio.policy.budget import parse_size

    placement = Placement(ram_budget=parse_size(args.ram_budget) if args.ram_budget else None,
                          cache_per_layer=args.cache_per_layer, pin=args.pin, context=args.ctx, kv_type=args.kv_type,
                          parallel=args.parallel)
    model = load(model_path(args) or default_model_path(), resident=False)
    past = HistoryFile.for_model(model).load() if args.history else None
    limits = memory_limits()
    speed = None
    if args.measure:
        switches = Settings.read()
        kernels = engine_kernels(kernels_name(getattr(args, "kernels", None), switches), switches)
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
                     + (f" x {plan.parallel} sequences (--parallel)" if plan.parallel > 1 else "")
                     + _sliding_note(a, plan.context)),
        ("working", gb(plan.working)),
        ("experts in", f"the page cache: {plan.experts_total} experts of {gb(plan.expert_nbytes)} = "
                       f"{gb(plan.experts_nbytes)}, all fit (a read-only mapping of the file, "
                       "filled by kernel read-ahead; no pool)") if plan.page_cache else
        ("expert pool", f"{plan.slots} slots x {gb(plan.slot_nbytes)} = {gb(plan.pool)} "
                        f"({plan.slots}/{plan.experts_total} experts{', all fit' if plan.all_experts_fit else ''}; "
                        f"a slot holds one expert of {gb(plan.expert_nbytes)} aligned for O_DIRECT)"),
        ("pinned", f"{plan.pinned_slots} slots = {gb(plan.pinned_slots * plan.slot_nbytes)}"),
        ("warm start", plan.warm_start),
        ("expected hit rate", hit),
        ("per token", f"compute ~{plan.compute_s_per_token * 1e3:.1f} ms, expert reads ~"
                      f"{plan.disk_s_per_token * 1e3:.1f} ms -> bound by {plan.bottleneck} "
                      f"(compute: {plan.speed_source}; reads at an assumed {ASSUMED_DISK_BYTES_PER_S / 1e9:.1f} GB/s)"),
    ] + [("note", note) for note in plan.notes]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
