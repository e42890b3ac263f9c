"""The plots: ``replay --plot``, ``trace-stats --plot`` on a trace of the shipped model and ``plot`` on the samples
of ``run --stats-json``, each a valid PNG or SVG of its stated size; and the per-layer hit rates they draw, on
hand-made traces whose answer is known."""
from __future__ import annotations

import json
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from support import run_cli

from colibri_aio.models import default_model_path

pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install 'colibri-aio[plot]')")

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk, after checking the signature and that chunk's CRC."""
    import zlib

    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, "not a PNG"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    assert struct.unpack(">I", data[29:33])[0] == zlib.crc32(data[12:29])
    assert data.endswith(b"IEND\xaeB`\x82")                          # the closing chunk: the file is whole
    return struct.unpack(">II", data[16:24])


def svg_root(path: Path) -> ET.Element:
    root = ET.parse(path).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    return root


def svg_text(root: ET.Element) -> str:
    return " ".join(t.strip() for t in root.itertext() if t.strip())


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A route trace of the shipped model: 9 prompt and 64 decoded positions."""
    out = tmp_path_factory.mktemp("trace") / "tiny.jsonl"
    r = run_cli("trace", str(default_model_path()), "--prompt", "The list type is a mutable sequence and",
                "--max-tokens", "64", "--out", str(out))
    assert r.returncode == 0, r.stderr
    return out


def test_replay_plot_png_and_svg(trace: Path, tmp_path: Path) -> None:
    png = tmp_path / "replay.png"
    r = run_cli("replay", str(trace), "--policy", "lru,lfu", "--cache-per-layer", "1,2,4,8", "--plot", str(png))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[1].split()[0] == "policy"            # the table is printed as without --plot
    assert png_size(png) == (800, 500)
    svg = tmp_path / "replay.svg"
    r = run_cli("replay", str(trace), "--policy", "lru,lfu", "--cache-per-layer", "1,2,4,8", "--plot", str(svg))
    assert r.returncode == 0, r.stderr
    root = svg_root(svg)
    assert (root.get("width"), root.get("height")) == ("576pt", "360pt")  # 800x500 px at 100 dpi, in points
    words = svg_text(root)
    # Belady beside the policies asked for, although the grid did not name it.
    for label in ("lru", "lfu", "belady (optimum)", "cache slots per layer", "expert hit rate"):
        assert label in words, label


def test_replay_plot_with_each_trace_on_its_own(trace: Path, tmp_path: Path) -> None:
    svg = tmp_path / "each.svg"
    r = run_cli("replay", str(trace), str(trace), "--each", "--policy", "lru,belady", "--cache-per-layer", "2,4",
                "--plot", str(svg))
    assert r.returncode == 0, r.stderr
    assert "belady (optimum)" in svg_text(svg_root(svg))


def test_trace_stats_plot_png_and_svg(trace: Path, tmp_path: Path) -> None:
    png = tmp_path / "stats.png"
    r = run_cli("trace-stats", str(trace), "--plot", str(png))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("runs 1  positions 73  experts 32  top-4")
    assert png_size(png) == (1000, 800)
    svg = tmp_path / "stats.svg"
    assert run_cli("trace-stats", str(trace), "--json", "--plot", str(svg)).returncode == 0
    root = svg_root(svg)
    assert (root.get("width"), root.get("height")) == ("720pt", "576pt")
    words = svg_text(root)
    # top-4 of 32 experts: LRU caches of 4, 8 and 16 slots per layer; the heat map of routing counts below.
    for label in ("LRU, 4 slots/layer", "LRU, 8 slots/layer", "LRU, 16 slots/layer", "routing counts",
                  "expert (of 32, top-4 per token)", "selections"):
        assert label in words, label


def test_plot_of_run_stats_json(tmp_path: Path) -> None:
    samples = tmp_path / "stats.jsonl"
    r = run_cli("run", "--prompt", "The list type is", "--max-tokens", "48", "--stats-json", str(samples),
                "--stats-interval", "0.05")
    assert r.returncode == 0, r.stderr
    n = len(samples.read_text().splitlines())
    assert n >= 1
    png = tmp_path / "run.png"
    r = run_cli("plot", str(samples), "-o", str(png))
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip() == f"{n} samples -> {png}"
    assert png_size(png) == (800, 900)
    svg = tmp_path / "run.svg"
    assert run_cli("plot", str(samples), "--out", str(svg)).returncode == 0
    words = svg_text(svg_root(svg))
    for label in ("tok/s", "expert hit %", "pinned", "cached", "prefetched", "MB/s", "RSS MB"):
        assert label in words, label


@pytest.mark.parametrize("args", [
    ["replay", "{trace}", "--plot", "{tmp}/out.jpg"],
    ["trace-stats", "{trace}", "--plot", "{tmp}/out"],
    ["plot", "{trace}", "-o", "{tmp}/out.pdf"],
    ["replay", "{trace}", "--plot", "{tmp}/no/such/folder/out.png"],
    ["plot", "{tmp}/none.jsonl", "-o", "{tmp}/out.png"],
    ["plot", "{trace}", "-o", "{tmp}/out.png"],                      # a route trace is not run --stats-json samples
])
def test_a_mistake_is_one_line_and_exit_2(trace: Path, tmp_path: Path, args: list[str]) -> None:
    r = run_cli(*[a.format(trace=trace, tmp=tmp_path) for a in args])
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("colibri-aio: error: "), r.stderr
    assert not list(tmp_path.glob("out*"))


@pytest.mark.parametrize("command", [["replay", "{trace}"], ["trace-stats", "{trace}"], ["plot", "{trace}", "-o"]])
def test_without_matplotlib_a_plot_is_one_line_and_exit_2(trace: Path, tmp_path: Path, command: list[str]) -> None:
    args = [a.format(trace=trace) for a in command]
    args += [str(tmp_path / "out.png")] if args[-1] == "-o" else ["--plot", str(tmp_path / "out.png")]
    code = ("import sys; sys.modules['matplotlib'] = None; from colibri_aio.cli.main import main; "
            "sys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr == "colibri-aio: error: plots need matplotlib: pip install 'colibri-aio[plot]'\n"
    assert r.stdout == ""                                              # refused before the work, not after


def _record(pos: int, layer: int, experts: list[int]) -> dict:
    return {"kind": "route", "run": 0, "phase": "decode", "pos": pos, "token": 0, "layer": layer,
            "experts": experts, "weights": [1.0 / len(experts)] * len(experts)}


def test_layer_hit_rates_are_each_layers_own_lru() -> None:
    from colibri_aio.plots import layer_hit_rates, routing_counts
    from colibri_aio.policy.replay import Trace, steps_from_records

    # Layer 0 cycles over 3 experts (an LRU of 2 never hits, of 3 hits from the 4th position on);
    # layer 1 always picks expert 5 (a hit from the 2nd position on); top-1 of 8 experts.
    cycle = [0, 1, 2] * 4
    records = [r for pos, e in enumerate(cycle) for r in (_record(pos, 0, [e]), _record(pos, 1, [5]))]
    trace = Trace(2, 8, 1, 1000, (), steps_from_records(records))
    rates = layer_hit_rates(trace, [2, 3], warmup=0.0)
    assert rates == {0: [0.0, 9 / 12], 1: [11 / 12, 11 / 12]}
    header = {"block_count": 2, "expert_count": 8, "expert_used_count": 1}
    _, counts = routing_counts([header, *records])
    assert counts[0].tolist() == [4, 4, 4, 0, 0, 0, 0, 0] and counts[1].tolist() == [0] * 5 + [12, 0, 0]


def test_samples_must_be_run_stats_json(tmp_path: Path) -> None:
    from colibri_aio.errors import UserError
    from colibri_aio.plots import read_samples

    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps({"t": 1.0, "tok/s": 3.0}) + "\n\n" + "{not json\n")
    with pytest.raises(UserError, match=r"s.jsonl:3: not a JSON line"):
        read_samples(path)
    path.write_text("")
    with pytest.raises(UserError, match="no samples"):
        read_samples(path)


def test_a_run_without_a_block_device_is_drawn_without_device_figures(tmp_path: Path) -> None:
    from colibri_aio.plots import read_samples, stats_figure

    base = {"seconds": 0.5, "tok/s": 10.0, "pin%": 10.0, "lru%": 60.0, "pre%": 20.0, "ourMB/s": 1.5,
            "RSS_MB": 90.0, "rMB/s": None, "%util": None}
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps({**base, "t": 100.0 + i / 2}) + "\n" for i in range(4)))
    svg = tmp_path / "s.svg"
    stats_figure(read_samples(path), svg, title="no device")
    words = svg_text(svg_root(svg))
    assert "no block device under the model: no device figures" in words
    assert "expert reads MB/s" in words and "%util" not in words
