"""The usage history file behaves like a cache: a bad file is set aside, an unwritable place is a warning,
concurrent runs merge, and it can be turned off."""
from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import structlog

from colibri_aio import Engine
from colibri_aio.engine import history as history_module
from colibri_aio.engine.history import HistoryFile, default_usage_path, read_history
from colibri_aio.errors import UserError
from colibri_aio.gguf.model import load
from colibri_aio.policy.usage import UsageHistory, model_fingerprint
from support import FIXTURES, fixture

MODEL = fixture("tiny_q8_0.gguf")


@pytest.fixture(scope="module")
def model():
    return load(MODEL, resident=False)


def _run_with(store: HistoryFile, *selections: tuple[int, list[int]]) -> UsageHistory:
    run = store.empty()
    for layer, experts in selections:
        run.record(layer, experts)
    return run


def test_default_place_follows_xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    fp = model_fingerprint(model)
    assert default_usage_path(fp) == tmp_path / "cache" / "colibri_aio" / "usage" / f"{fp}.json"
    assert HistoryFile.for_model(model).path == default_usage_path(fp)


def test_save_then_load_and_nothing_left_behind(tmp_path: Path, model) -> None:
    store = HistoryFile.for_model(model, tmp_path / "sub" / "h.json")
    assert store.load().runs == 0                                    # missing: a new, empty history
    assert store.save(_run_with(store, (1, [0, 3])))
    assert store.save(_run_with(store, (1, [3])))
    back = store.load()
    assert back.runs == 2
    np.testing.assert_allclose(back.counts[1, [0, 3]], [0.9, 1.9])
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["h.json"]  # no temporary or lock file
    assert not store.save(store.empty())                              # a run that used nothing adds nothing


def _valid_doc(model) -> dict:
    return UsageHistory.for_model(model).to_json()


@pytest.mark.parametrize("name,content", [
    ("random bytes", bytes(range(256)) * 4),
    ("truncated JSON", b'{"format": "colibri-aio-usage", "version": 1, "counts": [[0.0, 1'),
    ("empty", b""),
    ("negative count", None),
    ("another model", None),
    ("another version", None),
])
def test_a_bad_file_is_set_aside_with_one_warning(tmp_path: Path, model, name: str, content: bytes | None) -> None:
    store = HistoryFile.for_model(model, tmp_path / "h.json")
    if content is None:
        doc = _valid_doc(model)
        if name == "negative count":
            doc["counts"][0][1] = -4.0
        elif name == "another model":
            doc["fingerprint"] = "0" * 32
        else:
            doc["version"] = 99
        content = json.dumps(doc).encode()
    store.path.write_bytes(content)
    with structlog.testing.capture_logs() as logs:
        assert store.load().runs == 0
    assert [e["log_level"] for e in logs] == ["warning"]
    assert str(store.path) in logs[0]["event"] and "moved it to h.json.bad" in logs[0]["event"]
    assert (tmp_path / "h.json.bad").read_bytes() == content and not store.path.exists()
    assert store.save(_run_with(store, (0, [1])))                     # and a new one starts
    assert store.load().runs == 1


def test_an_unreadable_file_is_set_aside(tmp_path: Path, model) -> None:
    store = HistoryFile.for_model(model, tmp_path / "h.json")
    store.path.mkdir()                                                # reading it fails (a folder in its place)
    with structlog.testing.capture_logs() as logs:
        assert store.load().runs == 0
    assert len(logs) == 1 and "cannot read" in logs[0]["event"]
    assert (tmp_path / "h.json.bad").is_dir()


def test_a_bad_file_that_cannot_be_moved_is_left_alone(tmp_path: Path, model,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the file cannot be renamed, this run neither reads nor writes it (one warning in all)."""
    store = HistoryFile.for_model(model, tmp_path / "h.json")
    store.path.write_bytes(b"garbage")

    def refuse(src: object, dst: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(history_module.os, "replace", refuse)
    with structlog.testing.capture_logs() as logs:
        assert store.load().runs == 0
        assert not store.save(_run_with(store, (0, [1])))
    assert len(logs) == 1 and "neither reads nor writes it" in logs[0]["event"]
    assert store.path.read_bytes() == b"garbage"


def test_an_unwritable_place_is_one_warning(tmp_path: Path, model) -> None:
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the folder should be")
    store = HistoryFile.for_model(model, blocker / "colibri_aio" / "usage" / "h.json")
    with structlog.testing.capture_logs() as logs:
        assert store.load().runs == 0                                  # nothing to read: no warning
        assert not store.save(_run_with(store, (0, [1])))
    assert len(logs) == 1 and "not saved" in logs[0]["event"] and "--no-history" in logs[0]["event"]


def test_a_held_lock_is_waited_for_a_bounded_time(tmp_path: Path, model, monkeypatch: pytest.MonkeyPatch) -> None:
    store = HistoryFile.for_model(model, tmp_path / "h.json")
    monkeypatch.setattr(history_module, "LOCK_TIMEOUT", 0.2)
    other = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY);"
                              "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(30)",
                              str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "locked"
        with structlog.testing.capture_logs() as logs:
            assert not store.save(_run_with(store, (0, [1])))
        assert len(logs) == 1 and "stayed locked" in logs[0]["event"]
    finally:
        other.kill()
        other.wait()


def _worker(path: str, fingerprint: str, shape: tuple[int, int], expert: int, barrier) -> None:
    store = HistoryFile(Path(path), fingerprint, *shape)
    store.load()                       # every worker starts from the same (empty) file ...
    run = store.empty()
    run.record(0, [expert])
    barrier.wait()                     # ... and all save at once
    assert store.save(run)


def test_concurrent_runs_merge_instead_of_losing_updates(tmp_path: Path, model) -> None:
    path, fp = tmp_path / "h.json", model_fingerprint(model)
    shape = (model.args.block_count, model.args.expert_count)
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(4)
    workers = [ctx.Process(target=_worker, args=(str(path), fp, shape, e, barrier)) for e in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert [w.exitcode for w in workers] == [0] * 4
    merged = read_history(path, fp)
    assert merged.runs == 4
    # Each run counted one expert; the later ones faded the earlier ones by 0.9 each.
    np.testing.assert_allclose(sorted(merged.counts[0, :4]), [0.729, 0.81, 0.9, 1.0])


def test_four_concurrent_cli_runs_all_count(tmp_path: Path, model) -> None:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    runs = [subprocess.Popen([sys.executable, "-m", "colibri_aio", "run", str(MODEL), "--max-tokens", "3"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=FIXTURES.parent)
            for _ in range(4)]
    errors = [r.communicate(timeout=300)[1] for r in runs]
    assert [r.returncode for r in runs] == [0] * 4, errors
    path = Path(tmp_path) / "colibri_aio" / "usage" / f"{model_fingerprint(model)}.json"
    assert read_history(path, model_fingerprint(model)).runs == 4


async def test_a_damaged_history_never_stops_a_run(monkeypatch: pytest.MonkeyPatch, model) -> None:
    path = default_usage_path(model_fingerprint(model))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(300))
    with structlog.testing.capture_logs() as logs:
        async with await Engine.open(MODEL, io="pread") as engine:
            text = [p.token async for p in engine.generate("The list type", max_tokens=3)]
    assert len(text) == 3 and len([e for e in logs if e["log_level"] == "warning"]) == 1
    assert path.with_name(path.name + ".bad").exists()
    assert read_history(path, model_fingerprint(model)).runs == 1     # this run's use was saved anew


async def test_history_off_reads_and_writes_nothing(model) -> None:
    path = default_usage_path(model_fingerprint(model))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"garbage stays untouched")
    with structlog.testing.capture_logs() as logs:
        async with await Engine.open(MODEL, io="pread", history=False) as engine:
            [p async for p in engine.generate("The list type", max_tokens=3)]
    complaints = [e for e in logs if e["log_level"] != "info"]  # info events (backend, placement) say nothing of it
    assert not complaints and path.read_bytes() == b"garbage stays untouched"
    with pytest.raises(UserError, match="--no-history"):
        await Engine.open(MODEL, pin="auto", history=False)
