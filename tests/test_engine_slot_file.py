"""A slot's KV cache saved to a file and restored in another engine: the prompt that continues it prefills only
the rest, and its logits equal the original engine's bit for bit; a file of another model, context or KV type
(or no slot file at all) is refused in one line."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from colibri_aio import Engine, SyncEngine, UserError
from support import fixture, main_in_process

PROMPT = "The list type is a mutable sequence"


async def _continue(engine: Engine, ids: list[int], slot_ids: list[int]) -> list[tuple[int, float, int]]:
    return [(p.token, p.logprob, p.cached_tokens)
            async for p in engine.generate(ids + slot_ids, max_tokens=6, logprobs=1)]


@pytest.mark.parametrize("stem,kv_type", [("tiny_q8_0", "f16"), ("tiny_q8_0", "f32"), ("gptoss_mxfp4", "f16"),
                                          ("qwen3next_q8_0", "f16"), ("deepseek2_q8_0", "f16")])
async def test_a_restored_slot_continues_as_the_original_bit_for_bit(stem: str, kv_type: str, tmp_path: Path) -> None:
    """gpt-oss: its sliding-window ring; qwen3next: recurrent states; deepseek2: MLA's latent cache."""
    model, file = fixture(f"{stem}.gguf"), tmp_path / "slot.npz"
    async with await Engine.open(model, io="pread", kv_type=kv_type, history=False) as engine:
        ids = engine.prompt_ids(PROMPT)
        first = [p.token async for p in engine.generate(ids, max_tokens=3)]
        held = engine.net.n_past
        assert await engine.save_slot(file) > 0
        original = await _continue(engine, ids, first[:-1] + [5, 9])
    async with await Engine.open(model, io="pread", kv_type=kv_type, history=False, parallel=2) as engine:
        assert await engine.restore_slot(file, slot=1) == held
        restored = await _continue(engine, ids, first[:-1] + [5, 9])
    assert original == restored
    assert restored[0][2] == held          # everything the file held was reused


async def test_files_of_another_model_context_or_kv_type_are_refused(tmp_path: Path) -> None:
    file = tmp_path / "slot.npz"
    async with await Engine.open(fixture("tiny_q8_0.gguf"), io="pread", n_ctx=128, history=False) as engine:
        [_ async for _ in engine.generate(PROMPT, max_tokens=2)]
        await engine.save_slot(file)
    cases = [(fixture("tiny_q4_k.gguf"), dict(n_ctx=128), "another model"),
             (fixture("tiny_q8_0.gguf"), dict(n_ctx=64), "another context size"),
             (fixture("tiny_q8_0.gguf"), dict(n_ctx=128, kv_type="f32"), "another KV type")]
    for model, options, phrase in cases:
        async with await Engine.open(model, io="pread", history=False, **options) as engine:
            before = engine.net.n_past
            with pytest.raises(UserError, match=phrase):
                await engine.restore_slot(file)
            assert engine.net.n_past == before
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not a slot file at all")
    async with await Engine.open(fixture("tiny_q8_0.gguf"), io="pread", n_ctx=128, history=False) as engine:
        with pytest.raises(UserError, match="not a slot file"):
            await engine.restore_slot(garbage)
        bare = tmp_path / "bare.npy"
        np.save(bare, np.zeros(3))
        with pytest.raises(UserError, match="not a slot file"):
            await engine.restore_slot(bare)
        with pytest.raises(UserError, match="no such slot file"):
            await engine.restore_slot(tmp_path / "missing.npz")
        with pytest.raises(UserError, match="no slot 3"):
            await engine.restore_slot(file, slot=3)


def test_sync_engine_saves_and_restores(tmp_path: Path) -> None:
    file = tmp_path / "slot.npz"
    with SyncEngine.open(fixture("tiny_q8_0.gguf"), io="pread", history=False) as engine:
        text = engine.text(PROMPT, max_tokens=4)
        engine.save_slot(file)
    with SyncEngine.open(fixture("tiny_q8_0.gguf"), io="pread", history=False) as engine:
        assert engine.restore_slot(file) > 0
        assert engine.text(PROMPT, max_tokens=4) == text


def test_run_with_a_prompt_cache_prefills_once(tmp_path: Path) -> None:
    file = tmp_path / "prompt.cache"
    model = str(fixture("tiny_q8_0.gguf"))
    args = ("run", model, "--prompt", PROMPT, "--max-tokens", "4", "--no-history", "--prompt-cache", str(file))
    code, out1, err1 = main_in_process(*args)
    assert code == 0, err1
    code, out2, err2 = main_in_process(*args)
    assert code == 0, err2
    assert out1 == out2 and "positions restored" in err2
    code, _, err = main_in_process(*args[:-2], "--ctx", "64", "--prompt-cache", str(file))
    assert code == 2 and len(err.strip().splitlines()) == 2 and "another context size" in err


async def test_a_slot_file_with_a_broken_table_is_refused_in_one_line(tmp_path: Path) -> None:
    """Meta whose per-layer positions are not pairs, or whose token ids disagree with n_past: refused, no
    traceback, the slot as it was."""
    import json

    file = tmp_path / "slot.npz"
    async with await Engine.open(fixture("tiny_q8_0.gguf"), io="pread", history=False) as engine:
        [_ async for _ in engine.generate(PROMPT, max_tokens=2)]
        await engine.save_slot(file)
        saved = dict(np.load(file))
        meta = json.loads(saved["meta"].tobytes())
        for broken, phrase in [({"held": [5] * len(meta["held"])}, "out of range"),
                               ({"held": "all"}, "out of range"),
                               ({"ids": meta["ids"][:-1]}, "n_past and ids disagree")]:
            np.savez(file, **{**saved, "meta": np.frombuffer(json.dumps({**meta, **broken}).encode(), np.uint8)})
            before = engine.net.n_past
            with pytest.raises(UserError, match=phrase):
                await engine.restore_slot(file)
            assert engine.net.n_past == before
