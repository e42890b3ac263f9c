"""A prompt's positions run together on ggml graphs, block by block (arch/decode_graphs.py: spans).

On the ggml backend a prompt runs in spans of at most PREFILL_CHUNK positions: per block one attention-and-
router graph over all the span's positions (products over every row at once, attention causal over the
cache), then its experts, each read once and multiplied over every (position, rank) cell routed to it in one
product, then one head graph for the last position. What these tests hold it to:

- llama.cpp's logits: bit for bit on every quantised family fixture (on a CPU of the oracle's class), as the
  per-operation prefill is;
- the same bits whatever the cache holds (experts in one batch or arriving one by one: one graph over the
  rows, or cells by batch);
- a prompt in spans of any length, or in several calls, continues one cache (within rounding of one span);
- what cannot run as a span runs per operation: a recurrent family, a ring the span would wrap, a switch set
  to ``ops``, a broken weight (whose place the per-operation pass names).
"""
from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from colibri_aio import Engine, NonFiniteError
from colibri_aio.arch import build_net, decode_graphs, llama4
from colibri_aio.engine.mapped_source import MappedExpertSource
from colibri_aio.gguf.model import load
from colibri_aio.kernels.backend import Kernels
from colibri_aio.kernels.ggml_cpu import has_gemm
from colibri_aio.settings import Settings

from test_arch_families import ggml  # noqa: F401 (the module's kernels, a fixture)
from support import FIXTURES, ORACLE, family_stems, fixture, oracle_ids, oracle_tolerance, rewrite_gguf

IDS = json.loads((ORACLE / "family_ids.json").read_text())["sequences"]
QUANTISED = sorted(s for s in family_stems() if not s.endswith("_f32") and (FIXTURES / f"{s}.gguf").exists()
                   and (ORACLE / f"{s}.llamacpp.npz").exists())


def _net(stem: str, kernels: Kernels, **settings: str):
    model = load(FIXTURES / f"{stem}.gguf")
    return build_net(model, MappedExpertSource(model), kernels=kernels, kv_type="f32",
                     settings=Settings.read(**settings))


def _spans(net) -> int:
    graphs = net.decode_graphs()
    return 0 if graphs is None else graphs.spans


def _prefill(net, ids: list[int], logits: str = "last") -> np.ndarray:
    net.reset()
    return asyncio.run(net.forward(ids, logits=logits))


@pytest.mark.parametrize("stem", QUANTISED)
def test_a_prompt_as_spans_gives_llamacpps_logits_bit_for_bit(stem: str, ggml: Kernels) -> None:  # noqa: F811
    net = _net(stem, ggml)
    with np.load(ORACLE / f"{stem}.llamacpp.npz") as ref:
        want = ref[sorted(ref.files)[0]]
    ids = IDS[0][: want.shape[0]]
    got_all = _prefill(net, ids, "all")
    last = _prefill(net, ids)
    recurrent = any(r is not None for r in net.args.recurrent_states())
    assert _spans(net) == (0 if recurrent else 2), stem
    # The oracle was made on an AVX-512 CPU, whose Q8_0 products other CPUs' kernels sum otherwise
    # (deepseek2lite's 26 blocks carry a moved code on: 6.5e-3 measured without AVX-512).
    rel = oracle_tolerance(0.0, 1e-2)
    if rel:
        np.testing.assert_allclose(got_all, want, rtol=0, atol=rel * float(np.abs(want).max()))
    else:
        assert np.array_equal(got_all, want), stem
    assert np.array_equal(last, got_all[-1]), stem          # the head of the last row alone: the same bits


@pytest.mark.parametrize("name", ["tiny_q8_0", "tiny_q4_k", "qwen2moe_q8_0", "deepseek2_q8_0", "gptoss_mxfp4"])
async def test_spans_give_the_same_bits_whether_experts_are_resident_or_arrive_one_by_one(monkeypatch,
                                                                                          name: str) -> None:
    """Every path a span's experts take gives the same bits: one graph over the rows (all resident), a product
    over each arriving batch's cells, and (Q8_0 experts) each expert's rows on llamafile's GEMM."""
    a = load(fixture(f"{name}.gguf")).args
    ids = [t % a.vocab_size for t in oracle_ids()[2]][:8]   # within gpt-oss's window of 8: spans
    moe_blocks = a.moe_block_count
    runs = {}
    for gemm, io, per_layer in (("0", "uring", 1), ("0", "uring", a.expert_used_count), ("0", "pread", a.expert_count),
                                ("0", "mmap", a.expert_count), ("1", "uring", 1), ("1", "mmap", a.expert_count)):
        monkeypatch.setenv("COLIBRI_GGML_EXPERT_GEMM", gemm)
        async with await Engine.open(fixture(f"{name}.gguf"), kernels="ggml", io=io, cache_per_layer=per_layer,
                                     prefetch="off", history=False) as engine:
            net = engine.net
            for attempt in ("cold", "again"):      # cold: experts arrive as read; again: resident if they fit
                net.reset()
                runs[gemm, io, per_layer, attempt] = await net.forward(ids, logits="all")
                assert net.decode_graphs().spans == (1 if attempt == "cold" else 2)
            on_gemm = any(net._span_per_expert(layer) for layer in range(a.block_count) if a.is_moe(layer))
            assert on_gemm == (gemm == "1" and name.endswith("q8_0") and has_gemm()), (gemm, name)
            if io == "mmap" and not on_gemm:   # every expert mapped the second time: one graph over the rows
                assert net.span_expert_graphs >= moe_blocks
            elif per_layer == 1 or on_gemm:    # experts arriving one by one, each batch as cells; or on the GEMM
                assert net.span_expert_graphs == 0
    want = runs["0", "mmap", a.expert_count, "cold"]
    for key, got in runs.items():
        assert np.array_equal(got, want), key


def test_spans_of_any_length_and_a_prompt_in_pieces_continue_one_cache(monkeypatch, ggml: Kernels) -> None:  # noqa: F811
    stem = "qwen2moe_f32"
    net = _net(stem, ggml)
    ids = IDS[0]
    whole = _prefill(net, ids, "all")
    assert _spans(net) == 1
    scale = float(np.abs(whole).max())
    monkeypatch.setattr(decode_graphs, "PREFILL_CHUNK", 5)     # 24 positions: spans of 5, 5, 5, 5 and 4
    pieces = _prefill(net, ids, "all")
    assert _spans(net) == 1 + 5
    np.testing.assert_allclose(pieces, whole, rtol=0, atol=1e-5 * scale)

    async def two_calls() -> np.ndarray:
        net.reset()
        first = await net.forward(ids[:7], logits="all")
        return np.concatenate([first, await net.forward(ids[7:], logits="all")])

    np.testing.assert_allclose(asyncio.run(two_calls()), whole, rtol=0, atol=1e-5 * scale)
    # more span sizes than the graphs keep: the oldest are dropped and traced again when they come back
    for n in range(2, 9):
        monkeypatch.setattr(decode_graphs, "PREFILL_CHUNK", n)
        np.testing.assert_allclose(_prefill(net, ids, "all"), whole, rtol=0, atol=1e-5 * scale)
    graphs = net.decode_graphs()
    assert len(graphs._span_rows) <= graphs.SPAN_SIZES
    assert {key[2] for key in graphs._graphs if key[1] == ("span",)} <= set(graphs._span_rows)


def test_what_cannot_run_as_a_span_runs_per_operation(ggml: Kernels) -> None:  # noqa: F811
    ids = IDS[0]
    for stem, settings in (("qwen3next_q8_0", {}), ("qwen2moe_q8_0", {"ggml_prefill": "ops"}),
                           ("qwen2moe_q8_0", {"ggml_experts": "each"})):
        net = _net(stem, ggml, **settings)
        _prefill(net, ids)
        assert _spans(net) == 0, (stem, settings)


@pytest.mark.parametrize("stem", ["gptoss_mxfp4", "llama4_q8_0"])
@pytest.mark.parametrize("kv_type", ["f32", "f16"])
def test_spans_run_past_a_sliding_window_ring_as_its_positions_one_by_one_would(monkeypatch, stem: str, kv_type: str,
                                                                                ggml: Kernels) -> None:  # noqa: F811
    """gpt-oss's sliding-window blocks keep a ring of 8 positions: a span attends over what the ring held
    before it and its own keys, then leaves its last 8 in the ring, however many positions it has and
    wherever it starts. The same bits in spans of any length and in any pieces (measured: equal), and with
    the decoded positions after them; held to the per-operation pass (which writes and reads one position's
    window at a time) within its NumPy attention's one flipped code (measured 1.6e-2 of max|logit| with an
    f32 cache, 0 with f16; test_arch_families.py's ATTENTION_ROUNDING_FLIP). llama4's chunked blocks, made
    chunks of 8 positions, likewise: a query sees the keys of its own chunk only."""
    monkeypatch.setattr(llama4, "CHUNK", 8)

    def run(settings: dict, chunk: int, pieces: tuple[int, ...]) -> np.ndarray:
        monkeypatch.setattr(decode_graphs, "PREFILL_CHUNK", chunk)
        model = load(FIXTURES / f"{stem}.gguf")
        net = build_net(model, MappedExpertSource(model), kernels=ggml, kv_type=kv_type,
                        settings=Settings.read(**settings))
        assert net.args.kv_windows()[0] == 8

        async def go() -> np.ndarray:
            out, start = [], 0
            for end in (*pieces, len(IDS[0])):
                out.append(await net.forward(IDS[0][start:end], logits="all"))
                start = end
            out += [(await net.forward([t]))[None] for t in IDS[0][:4]]      # decode on after the prompt
            return np.concatenate(out)

        got = asyncio.run(go())
        assert (_spans(net) > 0) == (settings.get("ggml_prefill") != "ops")
        return got

    per_operation = run({"ggml_prefill": "ops"}, 256, ())
    want = run({}, 256, ())
    np.testing.assert_allclose(want, per_operation, rtol=0, atol=0.02 * float(np.abs(per_operation).max()))
    for chunk, pieces in ((5, ()), (256, (3,)), (256, (7, 16)), (3, (10,))):
        assert np.array_equal(run({}, chunk, pieces), want), (chunk, pieces)


def test_a_broken_weight_in_a_span_is_named_by_the_per_operation_pass(tmp_path, ggml: Kernels) -> None:  # noqa: F811
    def poison(name: str, array: np.ndarray) -> list:
        if name == "blk.1.ffn_up_exps.weight":
            array = array.copy()
            array[3] = np.nan
        return [(name, array)]

    path = rewrite_gguf(FIXTURES / "qwen2moe_f32.gguf", tmp_path / "broken.gguf", tensors=poison)
    model = load(path)
    net = build_net(model, MappedExpertSource(model), kernels=ggml, kv_type="f32")
    with pytest.raises(NonFiniteError, match="layer 1 expert"):
        asyncio.run(net.forward(IDS[0]))
    assert _spans(net) == 0


@pytest.mark.parametrize("logits", ["all", "last"])
def test_a_span_given_up_leaves_its_rings_for_the_per_operation_pass(monkeypatch, logits: str,
                                                                     ggml: Kernels) -> None:  # noqa: F811
    """A span whose graphs show a non-finite value is run again per operation, with the rest of the prompt;
    the keys it would have left in gpt-oss's rings of 8 must not be there yet, or that pass would attend over
    them in place of the earlier positions' keys. After a context of 4, the third span of 5 of a prompt is given
    up after it has run whole: the first two stay, the rest is the per-operation pass's, as if it had run
    them from there."""
    ids = IDS[0]
    monkeypatch.setattr(decode_graphs, "PREFILL_CHUNK", 5)

    async def prompt_then_decode(net, given_up: bool) -> list[np.ndarray]:
        out = [await net.forward(ids[:4], logits=logits)]        # a context before: the rings hold 0..3
        if given_up:
            out.append(await net.forward(ids[4:], logits=logits))
        else:                           # positions 4..13 as spans, the rest per operation
            out.append(await net.forward(ids[4:14], logits=logits))
            monkeypatch.setattr(net, "_spans_fit", lambda: False)
            out.append(await net.forward(ids[14:], logits=logits))
            if logits == "last":
                del out[1]
        return [*out, *[(await net.forward([t]))[None] for t in ids[:3]]]

    def run(given_up: bool) -> list[np.ndarray]:
        model = load(FIXTURES / "gptoss_mxfp4.gguf")
        net = build_net(model, MappedExpertSource(model), kernels=ggml, kv_type="f16")
        blocks, calls = net._blocks_on_graphs, []

        async def third_given_up(graphs, tok):
            calls.append(len(tok))
            return await blocks(graphs, tok) and not (given_up and len(calls) == 4)

        monkeypatch.setattr(net, "_blocks_on_graphs", third_given_up)
        out = asyncio.run(prompt_then_decode(net, given_up))
        assert _spans(net) == 3
        return out

    got, want = run(given_up=True), run(given_up=False)
    assert np.array_equal(np.concatenate([g.reshape(-1) for g in got]), np.concatenate([w.reshape(-1) for w in want]))


class _Named(MappedExpertSource):
    """A mapped source that keeps what each block's router nearly chose."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self.named: dict[int, list[int]] = {}

    def near_misses(self, layer, experts) -> None:
        self.named.setdefault(layer, []).extend(experts)


@pytest.mark.parametrize("backend", ["ggml", "numpy"])
def test_a_prompt_tells_the_source_what_its_router_nearly_chose_and_a_decode_step_does_not(
        request, backend: str) -> None:
    """Each block of a prompt names, per position, the experts its router ranked just past the k it chose
    (what a warm start reads first), as a span on graphs and per operation alike; a decode step names none."""
    model = load(FIXTURES / "tiny_q8_0.gguf")
    source = _Named(model)
    kernels = request.getfixturevalue("ggml") if backend == "ggml" else None
    net = build_net(model, source, kernels=kernels, kv_type="f32", settings=Settings.read())
    a, ids = net.args, IDS[0][:9]
    asyncio.run(net.forward(ids))
    assert (_spans(net) >= 1) == (backend == "ggml")
    moe = [layer for layer in range(a.block_count) if a.is_moe(layer)]
    assert sorted(source.named) == moe
    k = a.expert_used_count
    for layer in moe:
        named = source.named[layer]
        assert len(named) == len(ids) * k and all(0 <= e < a.expert_count for e in named)
        if backend == "ggml":     # in rank order, position by position
            assert all(len(set(row)) == k for row in np.asarray(named).reshape(len(ids), k).tolist())
    source.named.clear()
    asyncio.run(net.forward(IDS[0][9:10]))
    assert source.named == {}
