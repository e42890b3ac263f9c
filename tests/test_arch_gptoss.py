"""gpt-oss beyond the oracle tests of test_arch_families: what its module reads from the file
(sliding layers, YaRN), the window's effect on logits, and one refusal per malformed input."""
from __future__ import annotations

import json

import numpy as np
import pytest

from colibri_aio.errors import ModelFormatError
from colibri_aio.gguf.model import load
from colibri_aio.kernels.ops import rope_cos_sin, rope_yarn_cos_sin

from support import FIXTURES, ORACLE, main_in_process, model_logits, rewrite_gguf

F32 = FIXTURES / "gptoss_f32.gguf"
IDS = json.loads((ORACLE / "family_ids.json").read_text())["sequences"][0]


def test_hyper_parameters_come_from_the_file() -> None:
    a = load(F32, resident=False).args
    assert (a.sliding_window, a.sliding) == (8, (True, False))  # llama.cpp: even layers slide
    assert a.routing.gating == "softmax_weight" and not a.routing.normalize
    s = a.rope_scaling
    assert (s.kind, s.factor, s.original_context, s.beta_fast, s.beta_slow) == ("yarn", 32, 4096, 32, 1)
    # llama.cpp's attention factor cancels, ggml's YaRN factor stays on cos and sin
    assert s.rotation_magnitude == pytest.approx(1 + 0.1 * np.log(32))


@pytest.mark.parametrize("pattern, sliding", [(0, (True, True)), (1, (False, False)), (3, (True, True))])
def test_sliding_window_pattern_key(pattern: int, sliding: tuple[bool, ...], tmp_path) -> None:
    path = rewrite_gguf(F32, tmp_path / "p.gguf", keys={"gpt-oss.attention.sliding_window_pattern": pattern})
    assert load(path, resident=False).args.sliding == sliding


def test_the_window_hides_keys_only_where_it_slides(tmp_path) -> None:
    """With a window wider than the sequence, layer 0 sees every key: logits change exactly from
    position 8 on (the fixture's window), so the window is what the oracles saw."""
    wide = model_logits(rewrite_gguf(F32, tmp_path / "wide.gguf", keys={"gpt-oss.attention.sliding_window": 1000}), IDS)
    narrow = model_logits(F32, IDS)
    diff = np.abs(wide - narrow).max(axis=-1)
    assert (diff[:8] == 0).all() and (diff[8:] > 1e-3).all()


def test_yarn_keeps_fast_pairs_and_interpolates_slow_ones() -> None:
    """gpt-oss-120b's rope (64 dims, base 150000, 4096 trained, factor 32): llama.cpp's ramp runs from
    pair 8 (floor of 8.09) to pair 18 (ceil of 17.40); below it the frequency is RoPE's, above it
    divided by 32, and both tables carry the magnitude."""
    pos = np.array([0, 1, 7, 1000])
    cos, sin = rope_yarn_cos_sin(pos, 64, 150000.0, factor=32.0, original_context=4096, magnitude=2.0)
    plain_c, plain_s = rope_cos_sin(pos, 64, 150000.0)
    np.testing.assert_allclose(cos[:, :9] / 2, plain_c[:, :9], atol=1e-6)
    np.testing.assert_allclose(sin[:, :9] / 2, plain_s[:, :9], atol=1e-6)
    angle = np.arctan2(sin[:, 18:], cos[:, 18:])
    theta = 150000.0 ** (-np.arange(36, 64, 2) / 64) / 32
    np.testing.assert_allclose(angle, np.angle(np.exp(1j * pos[:, None] * theta)), atol=1e-5)
    np.testing.assert_allclose(np.hypot(cos, sin), 2.0, rtol=1e-6)


def _drop(name: str):
    return lambda n, a: [] if n == name else [(n, a)]


# (rewrite, phrase of the one-line refusal)
REFUSALS = {
    "unequal_head_widths": (dict(keys={"gpt-oss.attention.value_length": 8}), "must be equal"),
    "no_sliding_window": (dict(drop_keys=("gpt-oss.attention.sliding_window",)),
                          "missing metadata key gpt-oss.attention.sliding_window"),
    "sliding_pattern_text": (dict(keys={"gpt-oss.attention.sliding_window_pattern": "alternate"}),
                             "sliding_window_pattern must be"),
    "longrope_scaling": (dict(keys={"gpt-oss.rope.scaling.type": "longrope"}),
                         "rope.scaling.type 'longrope' is not supported"),
    "yarn_factor_below_one": (dict(keys={"gpt-oss.rope.scaling.factor": 0.5}),
                              "YaRN scaling of gpt-oss needs rope.scaling.factor"),
    "no_sinks": (dict(tensors=_drop("blk.1.attn_sinks.weight")), "missing tensor blk.1.attn_sinks.weight"),
    "no_expert_bias": (dict(tensors=_drop("blk.0.ffn_down_exps.bias")), "missing tensor blk.0.ffn_down_exps.bias"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_gptoss_files_that_cannot_run_are_refused_in_one_line(case: str, tmp_path) -> None:
    rewrite, phrase = REFUSALS[case]
    path = rewrite_gguf(F32, tmp_path / f"{case}_bad.gguf", **rewrite)
    with pytest.raises(ModelFormatError, match=phrase):
        load(path)
    status, _, err = main_in_process("logits", str(path), "--ids", "1,2", "--out", str(tmp_path / "x.npy"))
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and phrase in lines[0] and "Traceback" not in err, err
