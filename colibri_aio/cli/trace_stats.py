"""``trace-stats``: the routing statistics of :mod:`colibri_aio.cli.route_stats` for a trace file, as a table or
one JSON document."""
from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Declare ``trace-stats`` and its options."""
    p = sub.add_parser("trace-stats", help="routing statistics of a trace: skew, locality, lookahead recall",
                       description="Per layer: expert-use entropy, top-10%% share, breadth, locality; per lookahead "
                                   "predictor: recall and precision of the next layer's top-k.")
    p.add_argument("trace", type=Path, help="a file written by `trace`")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    p.add_argument("--plot", type=Path, default=None, metavar="FILE.png|.svg",
                   help="also draw the per-layer hit rate of an LRU cache and a layer x expert heat map of routing "
                        "counts (1000x800 px; needs pip install 'colibri-aio[plot]')")
    p.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    """Print the statistics of the trace; the exit status."""
    import json

    from colibri_aio.cli.route_stats import compute, format_table
    from colibri_aio.cli.route_trace import read_trace

    if args.plot is not None:
        from colibri_aio.plots import check_plot_path

        check_plot_path(args.plot, "--plot")
    stats = compute(read_trace(str(args.trace)))
    print(json.dumps(stats.as_dict(), indent=1) if args.json else format_table(stats))
    if args.plot is not None:
        _plot(args.trace, args.plot)
    return 0


def _plot(trace: Path, out: Path) -> None:
    """The trace's per-layer hit rate at k, 2k and 4k slots per layer (the top-k a token reads, and room for the
    next tokens' choices; fewer than the experts, or every layer would hit always) and its routing heat map."""
    from colibri_aio.cli.replay import load_traces
    from colibri_aio.cli.route_trace import read_trace
    from colibri_aio.plots import layer_hit_rates, routing_counts, trace_figure

    header, counts = routing_counts(read_trace(str(trace)))
    k, e = header["expert_used_count"], header["expert_count"]
    sizes = sorted({min(n, e - 1) for n in (k, 2 * k, 4 * k)} - {0}) or [1]
    rates = layer_hit_rates(load_traces([str(trace)]), sizes)
    trace_figure(header, counts, rates, sizes, out, title=trace.name)
