"""The committed family fixtures (fixtures/families.md) are what their spec and oracles say they are.

These check the stored files only; the engine's family modules test their
logits against the same oracles.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
from family_specs import FAMILIES, VOCAB  # noqa: E402

STEMS = [(f, s) for f in FAMILIES.values() for s in f.stems]
SEQ_LEN = len(json.loads((FIXTURES / "oracle" / "family_ids.json").read_text())["sequences"][0])


@pytest.mark.parametrize("family,stem", STEMS, ids=[s for _, s in STEMS])
def test_fixture_is_its_family(family, stem: str) -> None:
    reader = GGUFReader(FIXTURES / f"{stem}.gguf")
    arch = reader.fields["general.architecture"].contents()
    assert arch == family.arch
    blocks = family.config["num_hidden_layers"] + family.config.get("num_nextn_predict_layers", 0)
    assert reader.fields[f"{arch}.block_count"].contents() == blocks
    names = {t.name for t in reader.tensors}
    assert {f"blk.{blocks - 1}.attn_norm.weight", "output.weight", "token_embd.weight"} <= names
    assert f"blk.{blocks}.attn_norm.weight" not in names
    if family.arch == "glm4moe":  # the NextN block the engine must skip
        assert f"blk.{blocks - 1}.nextn.eh_proj.weight" in names
    if family.arch == "deepseek2":  # MLA as the current converter writes it
        assert {"blk.1.attn_k_b.weight", "blk.1.attn_v_b.weight", "blk.1.attn_kv_a_mqa.weight"} <= names
    if family.arch == "minimax-m2":  # sigmoid gating (llama.cpp's graph needs the key), partial RoPE, selection bias
        assert reader.fields["minimax-m2.expert_gating_func"].contents() == 2
        assert reader.fields["minimax-m2.rope.dimension_count"].contents() == 16
        assert "blk.1.exp_probs_b.bias" in names


@pytest.mark.parametrize("family,stem", STEMS, ids=[s for _, s in STEMS])
def test_oracles_have_one_row_per_position(family, stem: str) -> None:
    for kind in ("transformers", "llamacpp"):
        logits = np.load(FIXTURES / "oracle" / f"{stem}.{kind}.npz")["seq0"]
        assert logits.shape == (SEQ_LEN, VOCAB) and logits.dtype == np.float32
        assert np.isfinite(logits).all()


@pytest.mark.parametrize("family", FAMILIES.values(), ids=list(FAMILIES))
def test_f32_oracles_agree(family) -> None:
    """On F32 files transformers and llama.cpp computed the same model: the configs match llama.cpp."""
    stem = family.stems[0]
    hf = np.load(FIXTURES / "oracle" / f"{stem}.transformers.npz")["seq0"]
    lc = np.load(FIXTURES / "oracle" / f"{stem}.llamacpp.npz")["seq0"]
    assert np.abs(hf - lc).max() < 1e-4 * np.abs(hf).max()  # measured: <= 2.2e-6 (families.md)
    assert (hf.argmax(-1) == lc.argmax(-1)).all()


@pytest.mark.parametrize("family", ["mixtral", "gptoss", "minimaxm2", "llama4"])
def test_tokenizer_oracles_match_their_fixture(family: str) -> None:
    data = json.loads((FIXTURES / "oracle" / f"{family}_tokenizer_llamacpp.json").read_text(encoding="utf-8"))
    fields = GGUFReader(FIXTURES / data["fixture"]).fields
    assert len(data["cases"]) >= 50
    assert data["bos_id"] == fields["tokenizer.ggml.bos_token_id"].contents()
    assert data["eos_id"] == fields["tokenizer.ggml.eos_token_id"].contents()
    assert all(max(c["ids_plain"], default=0) < data["n_vocab"] for c in data["cases"])
