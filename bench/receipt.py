"""What every benchmark receipt starts with, and how it is written to ``evidence/``.

A receipt is ``NAME.json`` (every sample, host, commit, exact command) beside
``NAME.md`` (a short summary). Tables quote n, median and min–max
(:func:`spread`).
"""
from __future__ import annotations

import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from colibri_aio import cpu

# The source tree when run from a checkout (editable install); an installed wheel has no git history.
ROOT = Path(__file__).resolve().parents[1]


def stamp() -> str:
    """UTC time as used in receipt file names: 20261129T184208Z."""
    return dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def git_state(*paths: str) -> dict[str, Any]:
    """The checkout's commit (full and short; "unknown" outside git) and which of ``paths`` have
    uncommitted changes (``git status --porcelain`` lines), so a receipt says what code it measured."""
    def git(*args: str) -> str:
        try:
            done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return ""
        return done.stdout.strip() if done.returncode == 0 else ""

    sha = git("rev-parse", "HEAD") or "unknown"
    modified = git("status", "--porcelain", "--", *paths).splitlines() if paths and sha != "unknown" else []
    return {"sha": sha, "short": sha[:7] if sha != "unknown" else sha, "modified": modified}


def host_facts() -> dict[str, Any]:
    """Enough about the machine to read the numbers later, the CPU's vector extensions included (an AVX2 CPU and
    an AVX-512 one run different code)."""
    return {"hostname": platform.node(), "kernel": platform.release(), "machine": platform.machine(),
            "cpu": cpu.model(), "cpu_described": cpu.describe(), "cpu_flags": sorted(cpu.flags()),
            "cpus": os.cpu_count(), "mem_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "python": platform.python_version(), "loadavg": list(os.getloadavg())}


def header(script: str) -> dict[str, Any]:
    """Date, host, CPU, load average, commit and the exact command of this run."""
    return {"date": stamp(), "host": platform.node(), "cpu": cpu.describe(), "cpus": os.cpu_count(),
            "load_average": os.getloadavg(), "commit": git_state()["short"],
            "command": " ".join([script, *sys.argv[1:]])}


def host_line(receipt: dict[str, Any]) -> str:
    """The host as a receipt's Markdown names it: its name, then its CPU and vector extensions (an AVX2 CPU and an
    AVX-512 one run different code, so a number without them cannot be read)."""
    # A receipt is rendered again later (bench_commits --summarise), maybe elsewhere: never this machine's CPU.
    return f"host `{receipt['host']}` ({receipt.get('cpu') or 'CPU not recorded'}, {receipt.get('cpus', '?')} CPUs)"


def markdown_head(title: str, receipt: dict[str, Any], subject: str) -> list[str]:
    """A receipt's Markdown opening lines: its title and date; the host, commit, what ran (``subject``) and the load
    average at the end; the command. Each is followed by a blank line."""
    return [f"# {title} — {receipt['date']}", "",
            f"{host_line(receipt)}, commit `{receipt['commit']}`, {subject}, "
            f"load average at end {receipt['load_average']}", "", f"Command: `{receipt['command']}`", ""]


def spread(xs: list[float]) -> dict[str, float]:
    """n, median, min and max of a benchmark's samples: what every receipt table quotes."""
    return {"n": len(xs), "median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def write(out: Path, name: str, receipt: dict[str, Any], markdown: str) -> tuple[Path, Path]:
    """``out/name.json`` (every sample) and ``out/name.md`` (the summary); returns both paths."""
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / f"{name}.json", out / f"{name}.md"
    json_path.write_text(json.dumps(receipt, indent=1) + "\n")
    md_path.write_text(markdown)
    return json_path, md_path
