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
    p.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    """Print the statistics of the trace; the exit status."""
    import json

    from colibri_aio.cli.route_stats import compute, format_table
    from colibri_aio.cli.route_trace import read_trace

    stats = compute(read_trace(str(args.trace)))
    print(json.dumps(stats.as_dict(), indent=1) if args.json else format_table(stats))
    return 0
