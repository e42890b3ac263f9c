"""tools/bench_commits.py's summary: groups by a sample's fields or the run's, every sample counted, per-round ratios."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[1] / "tools"
sys.path.insert(0, str(TOOLS))
import bench_commits  # noqa: E402


def _runs() -> list[dict]:
    """Two rounds, two conditions, two samples a run: A gives 10 and 12, B twice that, in condition "x";
    in "y" B equals A."""
    runs = []
    for rnd in range(2):
        for arm, factor in (("a", 1.0), ("b", 2.0)):
            for cond, f in (("x", factor), ("y", 1.0)):
                for value in (10.0, 12.0):
                    runs.append({"round": rnd, "arm": arm, "condition": cond,
                                 "sample": {"arm": "ggml", "tok_s": value * f}})
    return runs


def _receipt(keys: list[str], runs: list[dict], summary: list[dict]) -> dict:
    """A receipt as bench_commits writes it, around these runs and summary rows."""
    return {"date": "d", "host": "h", "cpus": 2, "commit": "c", "a": {"name": "A", "sha": "a" * 40},
            "b": {"name": "B", "sha": "b" * 40}, "rounds": 2, "lock": None, "command": "cmd",
            "benchmark": ["tools/x.py"], "background": {}, "keys": keys, "metric": "tok_s",
            "summary": summary, "runs": runs}


def test_a_summary_groups_by_the_runs_condition_and_counts_every_sample() -> None:
    rows = {row["condition"]: row for row in bench_commits.summarise(_runs(), ["condition", "arm"], "tok_s")}
    assert set(rows) == {"x", "y"} and rows["x"]["arm"] == "ggml"
    assert rows["x"]["a"]["n"] == rows["x"]["b"]["n"] == 4
    assert rows["x"]["ratios"] == [2.0, 2.0] and rows["y"]["ratios"] == [1.0, 1.0]
    assert rows["x"]["b"]["median"] == 22.0 and rows["x"]["a_spread"] == 1.2


def test_summarise_writes_a_receipt_again_by_other_keys(tmp_path: Path) -> None:
    receipt = _receipt(["arm"], _runs(), [])
    path = tmp_path / "ab.json"
    path.write_text(json.dumps(receipt))
    done = subprocess.run([sys.executable, str(TOOLS / "bench_commits.py"), "--summarise", str(path),
                           "--key", "condition", "--metric", "tok_s"], capture_output=True, text=True, check=True)
    assert "| x | 11.000 [10.000–12.000] | 22.000 [20.000–24.000] | 2.000 [2.000–2.000] |" in done.stdout
    again = json.loads((tmp_path / "ab_tok_s.json").read_text())
    assert [row["condition"] for row in again["summary"]] == ["x", "y"]
    assert (tmp_path / "ab_tok_s.md").read_text() == bench_commits.markdown(again)


def test_runs_that_printed_no_value_are_counted_apart_not_summarised() -> None:
    """A benchmark whose reference failed in every run (its samples carry an error and no metric) still gives a
    summary of the engine that ran, and a receipt that says how many runs had no value."""
    runs = _runs() + [{"round": rnd, "arm": arm, "condition": "x", "sample": {"arm": "llama.cpp", "tok_s": None,
                                                                              "error": "ModuleNotFoundError"}}
                      for rnd in range(2) for arm in ("a", "b")]
    rows = {(row["condition"], row["arm"]): row for row in bench_commits.summarise(runs, ["condition", "arm"], "tok_s")}
    assert rows[("x", "ggml")]["ratios"] == [2.0, 2.0] and rows[("x", "ggml")]["failed"] == {"a": 0, "b": 0}
    failed = rows[("x", "llama.cpp")]
    assert failed["a"] is None and failed["b"] is None and failed["ratio"] is None and failed["failed"] == {"a": 2, "b": 2}
    receipt = _receipt(["condition", "arm"], runs, list(rows.values()))
    text = bench_commits.markdown(receipt)
    assert "| x | llama.cpp | - | - | - | - | - |" in text
    assert "- condition x, arm llama.cpp: 2 of A's runs and 2 of B's printed no tok_s" in text
