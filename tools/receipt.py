"""What every benchmark receipt starts with, and how it is written to evidence/."""
from __future__ import annotations

import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def stamp() -> str:
    """UTC time as used in receipt file names: 20261129T184208Z."""
    return dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def header(script: str) -> dict:
    """Date, host, CPUs, load average, commit and the exact command of this run."""
    return {
        "date": stamp(), "host": platform.node(), "cpus": os.cpu_count(), "load_average": os.getloadavg(),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                 cwd=ROOT).stdout.strip(),
        "command": " ".join([script, *sys.argv[1:]]),
    }


def spread(xs: list[float]) -> dict:
    """n, median, min and max of a benchmark's samples: what every receipt table quotes."""
    return {"n": len(xs), "median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def write(out: Path, name: str, receipt: dict, markdown: str) -> None:
    """``out/name.json`` (every sample) and ``out/name.md`` (the summary)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(receipt, indent=1))
    (out / f"{name}.md").write_text(markdown)
