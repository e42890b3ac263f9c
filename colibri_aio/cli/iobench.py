"""``iobench``: the expert-sized read benchmark of :mod:`colibri_aio.bench.iobench`, which declares its own options
and runs itself."""
from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Declare ``iobench``; its options and its handler are the benchmark's."""
    from colibri_aio.bench.iobench import add_iobench_arguments, run_iobench

    p = sub.add_parser("iobench", help="expert-sized read benchmark per I/O backend, paired with fio when present",
                       description="Random or sequential expert-sized reads per backend: GB/s, IOPS, latency "
                                   "p50/p99, and our/fio ratios on the same file in the same run.")
    add_iobench_arguments(p)
    p.set_defaults(func=run_iobench)
