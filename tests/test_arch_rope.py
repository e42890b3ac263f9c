"""RoPE scaling read from the file for every family (arch/rope.py), beyond the oracle tests of test_arch_families
(qwen3moeyarn_*: YaRN factor 4; mixtrallinear_*: linear factor 2): what each key means, the older
``rope.scale_linear``, that the scaling moves the logits far beyond the oracles' tolerance, and the one-line
refusal of a scaling type llama.cpp does not run for the family."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from colibri_aio.arch.rope import RopeScaling
from colibri_aio.gguf.model import load

from support import FIXTURES, ORACLE, assert_refused_in_one_line, model_logits, rewrite_gguf

YARN, LINEAR = FIXTURES / "qwen3moeyarn_f32.gguf", FIXTURES / "mixtrallinear_f32.gguf"
IDS = json.loads((ORACLE / "family_ids.json").read_text())["sequences"][0]
REL_TOL = 1e-4   # x max|logit|: test_arch_families' bound against the transformers oracle on F32 files


def _transformers(stem: str) -> np.ndarray:
    return np.load(ORACLE / f"{stem}.transformers.npz")["seq0"]


def test_the_scaled_fixtures_read_their_keys() -> None:
    s = load(YARN, resident=False).args.rope_scaling
    assert (s.kind, s.factor, s.original_context, s.beta_fast, s.beta_slow) == ("yarn", 4.0, 32, 32.0, 1.0)
    # no yarn_log_multiplier (qwen3moe does not read it): cos and sin carry ggml's 1 + 0.1 ln 4, as transformers'
    assert s.log_multiplier == 0 and s.rotation_magnitude == pytest.approx(1 + 0.1 * math.log(4.0))
    s = load(LINEAR, resident=False).args.rope_scaling
    assert (s.kind, s.factor, s.rotation_magnitude) == ("linear", 2.0, 1.0)
    assert load(FIXTURES / "mixtral_f32.gguf", resident=False).args.rope_scaling == RopeScaling(
        original_context=256)   # unscaled: llama.cpp's linear default with no factor


@pytest.mark.parametrize("path, arch", [(YARN, "qwen3moe"), (LINEAR, "llama")])
def test_unscaled_logits_are_far_from_the_oracle(path, arch: str, tmp_path) -> None:
    """The same file without its scaling keys (what the engine ran before it read them) misses the
    oracle by far more than its tolerance: the oracle tests see the scaling."""
    keys = tuple(f"{arch}.rope.scaling.{k}" for k in ("type", "factor", "original_context_length"))
    plain = model_logits(rewrite_gguf(path, tmp_path / "plain.gguf", drop_keys=keys), IDS)
    want = _transformers(path.stem)
    assert float(np.abs(plain - want).max()) > 100 * REL_TOL * float(np.abs(want).max())


def test_scale_linear_is_the_factor_of_older_files(tmp_path) -> None:
    """``rope.scale_linear`` (no rope.scaling.*): llama.cpp's freq scale 1 / scale_linear, linear by default;
    the file gives the linear fixture's logits."""
    old = rewrite_gguf(LINEAR, tmp_path / "old.gguf", keys={"llama.rope.scale_linear": 2.0},
                       drop_keys=("llama.rope.scaling.type", "llama.rope.scaling.factor"))
    s = load(old, resident=False).args.rope_scaling
    assert (s.kind, s.factor) == ("linear", 2.0) and s.params(16, 1e6).freq_scale == 0.5
    want = _transformers(LINEAR.stem)
    assert float(np.abs(model_logits(old, IDS) - want).max()) <= REL_TOL * float(np.abs(want).max())


def test_scaling_factor_wins_over_scale_linear(tmp_path) -> None:
    both = rewrite_gguf(LINEAR, tmp_path / "both.gguf", keys={"llama.rope.scale_linear": 8.0})
    assert load(both, resident=False).args.rope_scaling.factor == 2.0


@pytest.mark.parametrize("kind, factor", [("none", 2.0), ("yarn", 1.0), ("linear", 0.0)])
def test_what_runs_unscaled(kind: str, factor: float, tmp_path) -> None:
    """Type none ignores the factor, a factor of 1 (or 0: absent) scales nothing, as in llama.cpp."""
    path = rewrite_gguf(LINEAR, tmp_path / "k.gguf", keys={"llama.rope.scaling.type": kind,
                                                           "llama.rope.scaling.factor": factor})
    s = load(path, resident=False).args.rope_scaling
    assert (s.kind, s.factor) == ("none", 1.0)


def test_an_original_context_of_zero_is_the_training_context(tmp_path) -> None:
    path = rewrite_gguf(YARN, tmp_path / "z.gguf", keys={"qwen3moe.rope.scaling.original_context_length": 0})
    assert load(path, resident=False).args.rope_scaling.original_context == 128   # qwen3moe.context_length


def test_attn_factor_multiplies_cos_and_sin(tmp_path) -> None:
    path = rewrite_gguf(LINEAR, tmp_path / "a.gguf", keys={"llama.rope.scaling.attn_factor": 0.5})
    s = load(path, resident=False).args.rope_scaling
    cos, sin = s.tables(np.arange(4), 16, 1e6)
    np.testing.assert_allclose(np.hypot(cos, sin), 0.5, rtol=1e-6)
    assert s.params(16, 1e6).attn_factor == 0.5


@pytest.mark.parametrize("kind, phrase", [
    ("longrope", "rope.scaling.type 'longrope' is not supported for qwen3moe"),
    ("llama3", "rope.scaling.type 'llama3' is not supported for qwen3moe"),
])
def test_a_scaling_type_llamacpp_does_not_run_is_refused_in_one_line(kind: str, phrase: str, tmp_path) -> None:
    path = rewrite_gguf(YARN, tmp_path / f"{kind}_bad.gguf", keys={"qwen3moe.rope.scaling.type": kind})
    assert_refused_in_one_line(path, phrase, tmp_path)


def test_a_negative_factor_is_refused_in_one_line(tmp_path) -> None:
    path = rewrite_gguf(LINEAR, tmp_path / "neg_bad.gguf", keys={"llama.rope.scaling.factor": -2.0})
    assert_refused_in_one_line(path, "rope.scaling.factor -2.0 must be positive", tmp_path)
