"""UsageHistory: decay, hottest keys, the versioned file tied to the model's fingerprint."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from colibri_aio.errors import UserError
from colibri_aio.gguf.model import load
from colibri_aio.policy.usage import (
    UsageHistory,
    default_usage_path,
    model_fingerprint,
    pins_for,
)
from support import fixture


@pytest.fixture(scope="module")
def model():
    return load(fixture("tiny_f32.gguf"))


def test_counts_decay_per_run() -> None:
    u = UsageHistory("fp", 2, 4, decay=0.5)
    u.begin_run()
    u.record(0, [1, 2])
    u.record(0, [1])
    u.begin_run()
    u.record(1, [3])
    assert u.runs == 2
    np.testing.assert_allclose(u.counts, [[0, 1.0, 0.5, 0], [0, 0, 0, 1.0]])


def test_hottest_within_budget_and_per_layer_cap() -> None:
    u = UsageHistory("fp", 2, 4, counts=np.array([[5, 1, 0, 4], [3, 3, 2, 0]], float))
    assert u.hottest(3) == [(0, 0), (0, 3), (1, 0)]
    assert u.hottest(4, per_layer=1) == [(0, 0), (1, 0)]     # ties go to the lower id
    assert u.hottest(100) == [(0, 0), (0, 3), (1, 0), (1, 1), (1, 2), (0, 1)]  # never a zero count


def test_fingerprint_ignores_the_path_but_not_the_content(model, tmp_path: Path) -> None:
    copy = tmp_path / "renamed.gguf"
    shutil.copyfile(model.path, copy)
    assert model_fingerprint(load(copy)) == model_fingerprint(model)
    other = load(fixture("tiny_q8_0.gguf"))
    assert model_fingerprint(other) != model_fingerprint(model)


def test_save_load_roundtrip(model, tmp_path: Path) -> None:
    u = UsageHistory.for_model(model, decay=0.8)
    u.begin_run()
    u.record(1, [0, 3])
    path = tmp_path / "sub" / "usage.json"
    u.save(path)
    back = UsageHistory.load(path, model_fingerprint(model))
    np.testing.assert_allclose(back.counts, u.counts)
    assert (back.decay, back.runs) == (0.8, 1)
    assert [p.name for p in path.parent.iterdir()] == ["usage.json"]   # no temporary left behind


def test_history_of_another_model_is_refused(model, tmp_path: Path) -> None:
    path = tmp_path / "usage.json"
    UsageHistory("0" * 32, model.args.block_count, model.args.expert_count).save(path)
    with pytest.raises(UserError, match="another model"):
        UsageHistory.load(path, model_fingerprint(model))
    with pytest.raises(UserError, match="another model"):
        pins_for(str(path), model, 4)


def test_other_version_and_garbage_are_refused(model, tmp_path: Path) -> None:
    fp = model_fingerprint(model)
    doc = UsageHistory(fp, model.args.block_count, model.args.expert_count).to_json()
    cases = {"v2.json": json.dumps({**doc, "version": 2}), "bad.json": "{not json",
             "fmt.json": json.dumps({**doc, "format": "x"}), "cut.json": json.dumps({**doc, "counts": [[1]]})}
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(UserError):
            UsageHistory.load(tmp_path / name, fp)
    with pytest.raises(UserError, match="version 2"):
        UsageHistory.load(tmp_path / "v2.json", fp)
    with pytest.raises(UserError):
        UsageHistory.load(tmp_path / "missing.json", fp)


def test_pin_specs(model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    fp = model_fingerprint(model)
    assert default_usage_path(fp) == tmp_path / "cache" / "colibri_aio" / "usage" / f"{fp}.json"
    assert pins_for("auto", model, 4) == []             # no history yet: nothing pinned
    u = UsageHistory.for_model(model)
    u.record(0, [2, 2, 5])
    u.save(default_usage_path(fp))
    assert pins_for("auto", model, 4) == [(0, 2), (0, 5)]
    assert pins_for("off", model, 4) == []
    assert pins_for(str(default_usage_path(fp)), model, 1) == [(0, 2)]
