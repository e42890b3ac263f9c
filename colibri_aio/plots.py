"""Charts of the expert cache and the routing, drawn with matplotlib (the optional ``plot`` extra).

- :func:`replay_figure`: hit rate against cache size (slots per layer), one line per policy, with Belady's
  optimum beside them as the ceiling no policy can pass (``replay --plot``);
- :func:`trace_figure`: per-layer hit rate of an LRU cache of a few sizes, and a layer x expert heat map of
  routing counts (``trace-stats --plot``);
- :func:`stats_figure`: ``run --stats-json`` samples over time: tok/s, expert hit rate split pinned, cached
  and prefetched, disk MB/s and %util, RSS (``python -m colibri_aio plot``).

Every figure has a fixed size in pixels (:data:`REPLAY_PX`, :data:`TRACE_PX`, :data:`STATS_PX` at
:data:`DPI`; an SVG has the same size in points x 100/72) so that images of different runs compare side by
side. The format follows the file's suffix, ``.png`` or ``.svg``. matplotlib is imported only here and only
when a plot is asked for, on its non-interactive Agg backend (no display needed).
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from colibri_aio.cli.outfiles import check_writable
from colibri_aio.errors import UserError

DPI = 100
REPLAY_PX = (800, 500)
TRACE_PX = (1000, 800)
STATS_PX = (800, 900)
SUFFIXES = (".png", ".svg")


def check_plot_path(path: Path, option: str) -> None:
    """Refuse an output the plots cannot write, before any work: a suffix other than .png or .svg, a folder that
    is not there or not writable, or matplotlib missing."""
    if path.suffix.lower() not in SUFFIXES:
        raise UserError(f"{option} {path}: the file must end in .png or .svg, got {path.suffix or 'no suffix'!r}")
    check_writable(path, option)
    _pyplot()


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise UserError("plots need matplotlib: pip install 'colibri-aio[plot]'") from None
    matplotlib.use("Agg")  # files only: no display, whatever the environment asks for
    # An SVG keeps its words as text (found by a search, read by a screen reader, and smaller) rather than as
    # outlines of the glyphs.
    matplotlib.rcParams["svg.fonttype"] = "none"
    import matplotlib.pyplot as plt

    return plt


def _figure(px: tuple[int, int], rows: int = 1, cols: int = 1, **kw: Any) -> tuple[Any, Any]:
    plt = _pyplot()
    return plt.subplots(rows, cols, figsize=(px[0] / DPI, px[1] / DPI), dpi=DPI, layout="constrained", **kw)


def _save(fig: Any, path: Path, option: str) -> None:
    try:
        # No bbox_inches="tight": it would trim the figure to its content and so change the stated size.
        fig.savefig(path, dpi=DPI, format=path.suffix.lower().lstrip("."))
    except OSError as exc:
        raise UserError(f"{option} {path}: cannot write ({exc.strerror or exc})") from None
    finally:
        _pyplot().close(fig)


# --- replay ----------------------------------------------------------------------------------------------------

def _hit_rate(row: dict[str, Any]) -> float:
    """A replay row's hit rate: the rate itself, or the median over traces of ``replay --each``."""
    rate = row["hit_rate"]
    return rate["median"] if isinstance(rate, dict) else rate


def _label(row: dict[str, Any]) -> str:
    label = row["policy"]
    if row.get("scope", "layer") != "layer":
        label += f" ({row['scope']} scope)"
    if row.get("prefetch"):
        label += f" + prefetch {row['prefetch']}"
    return label


def replay_figure(rows: Sequence[dict[str, Any]], belady: Sequence[dict[str, Any]], path: Path, *,
                  title: str, option: str = "--plot") -> None:
    """Hit rate against slots per layer, one line per configuration of ``rows`` (replay's results or summary),
    ``belady``'s rows dashed beside them; written to ``path``."""
    fig, ax = _figure(REPLAY_PX)
    lines: dict[str, list[tuple[int, float, dict[str, Any]]]] = {}
    for row in rows:
        if row["policy"] != "belady":
            lines.setdefault(_label(row), []).append((row["cache_per_layer"], _hit_rate(row), row))
    for label, points in lines.items():
        points.sort(key=lambda p: p[0])
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        ax.plot(xs, ys, marker="o", label=label)
        spread = [p[2]["hit_rate"] for p in points]
        if all(isinstance(s, dict) for s in spread):  # --each: the min-max over traces as a band
            ax.fill_between(xs, [s["min"] for s in spread], [s["max"] for s in spread], alpha=0.15)
    opt = {}
    for row in belady:
        opt.setdefault((row.get("scope", "layer")), []).append((row["cache_per_layer"], _hit_rate(row)))
    for scope, points in opt.items():
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], "k--", marker="s",
                label="belady (optimum)" if scope == "layer" else f"belady ({scope} scope)")
    sizes = sorted({r["cache_per_layer"] for r in [*rows, *belady]})
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("cache slots per layer")
    ax.set_ylabel("expert hit rate (scored positions)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    _save(fig, path, option)


# --- trace-stats -------------------------------------------------------------------------------------------------

def routing_counts(records: Iterable[dict[str, Any]]) -> tuple[dict[str, Any], np.ndarray]:
    """The trace's header and its selections counted per (layer, expert), prefill and decode alike."""
    it = iter(records)
    header = next(it)
    counts = np.zeros((header["block_count"], header["expert_count"]), np.int64)
    for rec in it:
        np.add.at(counts[rec["layer"]], rec["experts"], 1)
    return header, counts


def layer_hit_rates(trace: Any, sizes: Sequence[int], warmup: float = 0.25) -> dict[int, list[float]]:
    """Per MoE layer, the hit rate of an LRU cache of each of ``sizes`` slots for that layer alone (what
    ``replay --policy lru --scope layer`` scores, layer by layer), after the same warm-up share."""
    from dataclasses import replace

    from colibri_aio.policy.replay import ReplayConfig, Trace, replay

    first = trace.leading_dense_block_count
    rates: dict[int, list[float]] = {}
    for layer in range(first, trace.block_count):
        steps = [replace(s, layer=0, predicted={}) for s in trace.steps if s.layer == layer]
        if not steps:
            continue
        one = Trace(1, trace.expert_count, trace.expert_used_count, trace.expert_nbytes, (), steps)
        rates[layer] = [replay(one, ReplayConfig(policy="lru", cache_per_layer=n, warmup=warmup)).stats.hit_rate
                        for n in sizes]
    return rates


def trace_figure(header: dict[str, Any], counts: np.ndarray, rates: dict[int, list[float]], sizes: Sequence[int],
                 path: Path, *, title: str, option: str = "--plot") -> None:
    """Per-layer hit rate (one line per cache size) above a layer x expert heat map of routing counts."""
    fig, (top, bottom) = _figure(TRACE_PX, 2, 1, height_ratios=[1, 1.4])
    layers = sorted(rates)
    for i, n in enumerate(sizes):
        top.plot(layers, [rates[layer][i] for layer in layers], marker="o", label=f"LRU, {n} slots/layer")
    top.set_ylim(0, 1.02)
    top.set_xlabel("layer")
    top.set_ylabel("expert hit rate")
    top.set_title(f"{title}: hit rate per layer (each layer's own cache, warm-up not scored)", fontsize=10)
    top.grid(True, alpha=0.3)
    top.legend(fontsize=8)
    if len(layers) <= 64:
        top.set_xticks(layers)
    image = bottom.imshow(counts, aspect="auto", interpolation="nearest", cmap="viridis", origin="lower")
    bottom.set_xlabel(f"expert (of {header['expert_count']}, top-{header['expert_used_count']} per token)")
    bottom.set_ylabel("layer")
    bottom.set_title("routing counts: selections of each expert by each layer", fontsize=10)
    fig.colorbar(image, ax=bottom, label="selections")
    _save(fig, path, option)


# --- run --stats-json --------------------------------------------------------------------------------------------

def read_samples(path: Path) -> list[dict[str, Any]]:
    """The JSON lines ``run --stats-json`` wrote; a UserError naming the line that is not one."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror or exc})") from None
    samples = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            sample = json.loads(line)
        except ValueError:
            raise UserError(f"{path}:{n}: not a JSON line of run --stats-json") from None
        if not isinstance(sample, dict) or "t" not in sample or "tok/s" not in sample:
            raise UserError(f"{path}:{n}: not a sample of run --stats-json (no t or tok/s)")
        samples.append(sample)
    if not samples:
        raise UserError(f"{path}: no samples (write them with run --stats-json FILE)")
    return samples


def _series(samples: Sequence[dict[str, Any]], name: str) -> list[float]:
    return [math.nan if s.get(name) is None else float(s[name]) for s in samples]


def stats_figure(samples: Sequence[dict[str, Any]], path: Path, *, title: str, option: str = "-o") -> None:
    """Four panels over the run's time: tok/s; hit rate stacked pinned/cached/prefetched; disk MB/s with %util;
    RSS. Device figures the run could not measure (no block device) are left out, and the panel says so."""
    fig, (tps, hits, disk, rss) = _figure(STATS_PX, 4, 1, sharex=True)
    t0 = samples[0]["t"] - samples[0].get("seconds", 0.0)
    t = [s["t"] - t0 for s in samples]
    tps.plot(t, _series(samples, "tok/s"), color="tab:blue")
    tps.set_ylabel("tok/s")
    tps.set_title(title, fontsize=10)
    parts = [(_series(samples, "pin%"), "pinned", "tab:green"), (_series(samples, "lru%"), "cached", "tab:blue"),
             (_series(samples, "pre%"), "prefetched", "tab:orange")]
    hits.stackplot(t, *[np.nan_to_num(p[0]) for p in parts], labels=[p[1] for p in parts],
                   colors=[p[2] for p in parts], alpha=0.8)
    hits.set_ylim(0, 100)
    hits.set_ylabel("expert hit %")
    hits.legend(fontsize=8, loc="lower right")
    device = _series(samples, "rMB/s")
    if all(math.isnan(v) for v in device):
        disk.text(0.5, 0.6, "no block device under the model: no device figures", transform=disk.transAxes,
                  ha="center", fontsize=9)
    else:
        disk.plot(t, device, color="tab:red", label="device MB/s")
        util = disk.twinx()
        util.plot(t, _series(samples, "%util"), color="tab:gray", linestyle=":", label="%util")
        util.set_ylim(0, 100)
        util.set_ylabel("%util")
        util.legend(fontsize=8, loc="upper right")
    disk.plot(t, _series(samples, "ourMB/s"), color="tab:purple", label="expert reads MB/s")
    disk.set_ylabel("MB/s")
    disk.legend(fontsize=8, loc="upper left")
    rss.plot(t, _series(samples, "RSS_MB"), color="tab:brown")
    rss.set_ylabel("RSS MB")
    rss.set_xlabel("seconds since the first sample")
    for ax in (tps, hits, disk, rss):
        ax.grid(True, alpha=0.3)
    _save(fig, path, option)
