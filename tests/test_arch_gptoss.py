"""gpt-oss beyond the oracle tests of test_arch_families: what its module reads from the file
(sliding layers, YaRN), the window's effect on logits, the sliding layers' ring KV cache (its
size in the plan, prefill splits, rewind and prefix reuse past the window), and one refusal
per malformed input."""
from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from colibri_aio.arch import build_net
from colibri_aio.engine.engine import Engine
from colibri_aio.engine.mapped_source import MappedExpertSource
from colibri_aio.errors import ModelFormatError
from colibri_aio.gguf.model import load
from colibri_aio.kernels.ops import rope_cos_sin, rope_yarn_cos_sin

from support import (FIXTURES, ORACLE, greedy_generation, greedy_replay, main_in_process, model_logits,
                     rewrite_gguf)

F32 = FIXTURES / "gptoss_f32.gguf"
KV_F16_TOL = 3e-3  # x max|logit|: keys and values rounded to float16, as test_arch_qwen3moe (measured 8e-4)
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


def _net(path=F32, n_ctx: int | None = None, kv_type: str = "f32"):
    """The net with a float32 KV cache (the oracles' precision) unless asked otherwise."""
    model = load(path)
    return build_net(model, MappedExpertSource(model), n_ctx=n_ctx, kv_type=kv_type)


def _transformers_oracle() -> np.ndarray:
    ref = np.load(ORACLE / "gptoss_f32.transformers.npz")
    return ref[sorted(ref.files)[0]]


def test_sliding_layers_keep_only_their_window_and_the_plan_counts_that() -> None:
    """Layer 0 slides (window 8): a ring of 8 positions; layer 1 keeps the whole context."""
    net = _net(n_ctx=200, kv_type="f16")
    a, cache = net.args, net.cache
    per_position = a.head_count_kv * (a.key_length + a.value_length) * 2           # 2 heads x (16 + 16) f16
    assert [len(k) for k in cache.k] == [len(v) for v in cache.v] == [8, 200]
    assert cache.nbytes == sum(k.nbytes + v.nbytes for k, v in zip(cache.k, cache.v)) == (8 + 200) * per_position
    assert a.kv_cache_nbytes(200) == cache.nbytes < a.block_count * 200 * per_position
    assert a.kv_cache_nbytes(5) == (5 + 5) * per_position   # a context shorter than the window: no ring


async def test_plan_kv_figure_is_the_engines_allocation() -> None:
    path = FIXTURES / "gptoss_mxfp4.gguf"
    status, out, err = main_in_process("plan", str(path), "--ram-budget", "600M", "--ctx", "300")
    assert status == 0 and "for 300 positions" in out and "1 of 2 layers slide: they hold 8" in out, err
    status, out, err = main_in_process("plan", str(path), "--ram-budget", "600M", "--ctx", "300", "--json")
    assert status == 0, err
    async with await Engine.open(path, io="pread", ram_budget="600M", n_ctx=300) as engine:
        cache = engine.net.cache
        owned = sum(k.nbytes + v.nbytes for k, v in zip(cache.k, cache.v))
        assert json.loads(out)["kv_cache"] == engine.plan.kv_cache == owned == (8 + 300) * 2 * (16 + 16) * 2  # f16


def test_a_ring_that_wrapped_still_gives_the_oracles_logits_in_any_split() -> None:
    """Prefill chunks longer than the window, shorter, and one token at a time all read the right keys
    from the ring: the transformers oracle's logits at every one of the 24 positions (window 8)."""
    want = _transformers_oracle()
    tol = 1e-4 * float(np.abs(want).max())
    net = _net()

    async def run(splits: list[int]) -> np.ndarray:
        net.reset()
        bounds = [0, *splits, len(IDS)]
        return np.concatenate([await net.forward(IDS[s:e], logits="all") for s, e in zip(bounds, bounds[1:])])

    for splits in ([], [3], [10], [7, 8, 17], [9, 12, 13, 14, 20]):
        assert float(np.abs(asyncio.run(run(splits)) - want).max()) <= tol, splits
    # the default f16 cache: the ring keeps keys rounded as a full cache would, and every split reads them alike
    net = _net(kv_type="f16")
    whole = asyncio.run(run([]))
    assert float(np.abs(whole - want).max()) <= KV_F16_TOL * float(np.abs(want).max())
    for splits in ([3], [10], [7, 8, 17]):
        np.testing.assert_allclose(asyncio.run(run(splits)), whole, rtol=0, atol=tol)


def test_rewind_within_the_ring_continues_and_beyond_it_is_refused() -> None:
    """After 20 positions the sliding layer holds 12..19: position 19 needs 12..18, so rewinding by one
    continues; position 15 would need 8..14, gone, so rewinding there is refused (resumable: 0)."""
    want = _transformers_oracle()
    tol = 1e-4 * float(np.abs(want).max())
    net = _net()
    asyncio.run(net.forward(IDS[:20]))
    assert [net.resumable(n) for n in (20, 19, 18, 15, 0)] == [20, 19, 0, 0, 0]
    with pytest.raises(ValueError, match="sliding-window"):
        net.rewind(15)
    assert net.n_past == 20
    net.rewind(19)
    got = asyncio.run(net.forward(IDS[19:], logits="all"))
    assert float(np.abs(got - want[19:]).max()) <= tol
    # within a context no longer than the window every prefix is held
    net.reset()
    asyncio.run(net.forward(IDS[:8]))
    assert net.resumable(3) == 3
    net.rewind(3)
    assert float(np.abs(asyncio.run(net.forward(IDS[3:], logits="all")) - want[3:]).max()) <= tol


def test_a_failed_call_that_overwrote_the_ring_forgets_the_context() -> None:
    """A call that fails after the sliding layer stored its keys (a broken expert, a cancellation) may have
    taken the slots of keys the context still needs: the net then holds nothing rather than wrong keys."""
    net = _net()
    asyncio.run(net.forward(IDS[:12]))

    def broken(*args, **kwargs):
        raise RuntimeError("expert read failed")

    net.expert_outputs = broken
    with pytest.raises(RuntimeError):
        asyncio.run(net.forward(IDS[12:18]))
    assert net.n_past == 0 and net.ids == []
    del net.expert_outputs
    want = _transformers_oracle()
    got = asyncio.run(net.forward(IDS, logits="all"))
    assert float(np.abs(got - want).max()) <= 1e-4 * float(np.abs(want).max())


async def test_chat_reuse_keeps_what_the_ring_holds_and_reruns_what_it_let_go() -> None:
    """The engine's prefix reuse on a sliding-window model: a continuation reuses the whole cache; a prompt
    diverging before the window is prefilled from scratch. Both give the bits of a fresh engine running
    the same calls."""
    bias = {t: -100.0 for t in (1, 3, 12)}   # no end of generation: replies run their full length

    async def greedy(engine: Engine, ids: list[int], n: int) -> tuple[list[int], list[float], int]:
        return await greedy_generation(engine, ids, n, bias)

    async def replay(calls: list[list[int]], n: int) -> tuple[list[int], list[float]]:
        async with await Engine.open(F32, io="pread", kernels="numpy") as fresh:
            return await greedy_replay(fresh, calls, n, bias)

    async with await Engine.open(F32, io="pread", kernels="numpy") as engine:
        p1 = IDS[:14]
        g1, _, cached1 = await greedy(engine, p1, 6)
        assert cached1 == 0 and engine.net.n_past == 19 > 8
        p2 = p1 + g1 + IDS[14:20]
        g2, lp2, cached2 = await greedy(engine, p2, 4)
        assert cached2 == 19   # everything the cache held: the ring holds the last 8 positions it needs
        assert await replay([p1, *([t] for t in g1[:-1]), p2[cached2:]], 4) == (g2, lp2)
        p3 = p2[:10] + IDS[20:24]   # diverges at 10: the ring (positions 21..28) let go of 3..9
        g3, lp3, cached3 = await greedy(engine, p3, 4)
        assert cached3 == 0
        assert await replay([p3], 4) == (g3, lp3)
