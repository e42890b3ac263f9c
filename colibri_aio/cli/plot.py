"""``plot``: draw the samples ``run --stats-json`` wrote (tok/s, expert hit rate by kind, disk MB/s and %util,
RSS over time) to a PNG or SVG file with matplotlib (:func:`colibri_aio.plots.stats_figure`)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from colibri_aio.errors import UserError


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Declare ``plot`` and its options."""
    p = sub.add_parser("plot", help="draw run --stats-json samples to a PNG or SVG file",
                       description="Draw the samples of run --stats-json FILE over time: tok/s, expert hit rate "
                                   "(pinned, cached, prefetched), disk MB/s and %util, RSS (800x900 px). Needs "
                                   "pip install 'colibri-aio[plot]'. For route traces: replay --plot and "
                                   "trace-stats --plot.")
    p.add_argument("samples", type=Path, help="a file written by run --stats-json")
    p.add_argument("-o", "--out", type=Path, required=True, metavar="FILE.png|.svg", help="the image to write")
    p.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    """Read the samples and draw them; the exit status."""
    from colibri_aio.plots import check_plot_path, read_samples, stats_figure

    if not args.samples.is_file():
        raise UserError(f"{args.samples}: no such file")
    check_plot_path(args.out, "--out")
    samples = read_samples(args.samples)
    stats_figure(samples, args.out, title=f"{args.samples.name}: {len(samples)} samples", option="--out")
    print(f"{len(samples)} samples -> {args.out}", file=sys.stderr)
    return 0
