"""UsageHistory: counts folded per run with decay, hottest keys, the versioned document and its checks."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from colibri_aio.errors import UserError
from colibri_aio.gguf.model import load
from colibri_aio.policy.usage import UsageHistory, model_fingerprint
from support import fixture


@pytest.fixture(scope="module")
def model():
    return load(fixture("tiny_f32.gguf"))


def test_runs_fold_in_with_decay() -> None:
    past = UsageHistory("fp", 2, 4, decay=0.5)
    run = past.empty()
    run.record(0, [1, 2])
    run.record(0, [1])
    after_one = past.with_run(run)
    second = past.empty()
    second.record(1, [3])
    after_two = after_one.with_run(second)
    assert (after_one.runs, after_two.runs) == (1, 2)
    np.testing.assert_allclose(after_two.counts, [[0, 1.0, 0.5, 0], [0, 0, 0, 1.0]])
    assert past.runs == 0 and not past.counts.any()   # folding makes a new history
    assert after_two.nonzero() == {(0, 1): 1.0, (0, 2): 0.5, (1, 3): 1.0}


def test_a_run_of_another_model_does_not_fold_in() -> None:
    with pytest.raises(ValueError):
        UsageHistory("a", 2, 4).with_run(UsageHistory("b", 2, 4))


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


def test_document_roundtrip(model) -> None:
    u = UsageHistory.for_model(model, decay=0.8)
    run = u.empty()
    run.record(1, [0, 3])
    u = u.with_run(run)
    back = UsageHistory.from_json(u.to_json(), model_fingerprint(model), "mem")
    np.testing.assert_allclose(back.counts, u.counts)
    assert (back.decay, back.runs) == (0.8, 1)


@pytest.mark.parametrize("change,phrase", [
    ({"version": 2}, "version 2"),
    ({"format": "x"}, "not a colibri-aio-usage"),
    ({"fingerprint": "0" * 32}, "another model"),
    ({"counts": [[1]]}, "damaged"),
    ({"counts": "lots"}, "damaged"),
    ({"runs": -1}, "damaged"),
    ({"runs": 1.5}, "damaged"),
    ({"decay": 0}, "damaged"),
    ({"decay": "nan"}, "damaged"),
])
def test_documents_that_are_refused(model, change: dict, phrase: str) -> None:
    fp = model_fingerprint(model)
    doc = {**UsageHistory(fp, model.args.block_count, model.args.expert_count).to_json(), **change}
    with pytest.raises(UserError, match=phrase):
        UsageHistory.from_json(doc, fp, "f.json")


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_counts_must_be_finite_and_not_negative(model, bad: float) -> None:
    fp = model_fingerprint(model)
    doc = UsageHistory(fp, model.args.block_count, model.args.expert_count).to_json()
    doc["counts"][1][2] = bad
    with pytest.raises(UserError, match="damaged"):
        UsageHistory.from_json(doc, fp, "f.json")
    with pytest.raises(UserError):
        UsageHistory.from_json(["not", "a", "dict"], fp, "f.json")
