"""The commands on every family's fixture: logits, trace (with lookahead predictions) and run."""
from __future__ import annotations

import json

import numpy as np
import pytest

from colibri_aio.gguf.model import load
from colibri_aio.text.tokenizer import Tokenizer

from support import ORACLE, fixture, run_cli

STEMS = ["qwen2moe_f32", "olmoe_f32", "mixtral_f32", "deepseek2_f32", "minimaxm2_f32", "llama4_f32", "qwen3next_f32",
         "dots1_f32", "ernie45moe_f32", "hunyuanmoe_f32"]
IDS = json.loads((ORACLE / "family_ids.json").read_text())["sequences"][0]


@pytest.mark.parametrize("stem", STEMS)
def test_logits_command_gives_the_oracle_rows(stem: str, tmp_path) -> None:
    out = tmp_path / "l.npy"
    r = run_cli("logits", str(fixture(f"{stem}.gguf")), "--ids", ",".join(map(str, IDS)), "--out", str(out),
                "--kernels", "numpy", "--kv-type", "f32")  # the oracle's cache is float32
    assert r.returncode == 0, r.stderr
    got, want = np.load(out), np.load(ORACLE / f"{stem}.transformers.npz")["seq0"]
    assert float(np.abs(got - want).max()) <= 1e-4 * float(np.abs(want).max())


@pytest.mark.parametrize("stem", STEMS)
def test_trace_records_routes_and_lookahead_of_every_family(stem: str, tmp_path) -> None:
    path, out = fixture(f"{stem}.gguf"), tmp_path / "t.jsonl"
    r = run_cli("trace", str(path), "--prompt", "The list type is", "--max-tokens", "3", "--out", str(out))
    assert r.returncode == 0, r.stderr
    model = load(path, resident=False)
    args = model.args
    header, *routes = [json.loads(x) for x in out.read_text().splitlines()]
    assert (header["block_count"], header["expert_count"], header["leading_dense_block_count"]) == (
        args.block_count, args.expert_count, args.leading_dense_block_count)
    tok = Tokenizer.from_path(path)
    prompt = tok.encode("The list type is", add_special=True)  # Mixtral's starts with BOS
    assert [r["token"] for r in routes if r["phase"] == "prefill" and r["layer"] == 0] == prompt
    scale = args.routing.scale if args.routing.scale not in (0.0, 1.0) else 1.0  # deepseek2 scales by 2.5
    for rec in routes:
        moe = args.is_moe(rec["layer"])  # a leading dense block routes nothing
        assert len(rec["experts"]) == len(set(rec["experts"])) == (args.expert_used_count if moe else 0)
        if moe and model.blocks[rec["layer"]].get("exp_probs_b.bias") is None:  # else: biased-score order
            assert rec["weights"] == sorted(rec["weights"], reverse=True)
        assert (0 < sum(rec["weights"]) <= scale + 1e-5) if moe else rec["weights"] == []
        assert ("predicted" in rec) == (rec["layer"] < args.block_count - 1 and args.is_moe(rec["layer"] + 1))
        for ranked in rec.get("predicted", {}).values():
            assert len(ranked) == 2 * args.expert_used_count


@pytest.mark.parametrize("stem", STEMS)
def test_run_generates_with_each_family(stem: str) -> None:
    r = run_cli("run", "--model", str(fixture(f"{stem}.gguf")), "--prompt", "def f(x):", "--max-tokens", "4",
                "--io", "pread", "--cache-per-layer", "2")
    assert r.returncode == 0, r.stderr


async def test_a_chat_template_that_writes_bos_gives_one_bos() -> None:
    """Mixtral's template starts with {{ bos_token }} and the file asks for BOS: the prompt starts with one."""
    from colibri_aio.engine.engine import Engine

    async with await Engine.open(fixture("mixtral_f32.gguf"), io="pread", cache_per_layer=2) as engine:
        bos = engine.tokenizer.bos_id
        chat = engine.prompt_ids([{"role": "user", "content": "Hello!"}])
        assert chat[0] == bos and chat[1] != bos
        assert engine.prompt_ids("<s>text")[:2] == [bos, bos]  # plain text is tokenized as written, like llama.cpp
