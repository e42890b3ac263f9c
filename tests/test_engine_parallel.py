"""Many streams, one engine: ``parallel=N`` decodes concurrent generations together, and each stream gets
the tokens (and the log-probabilities, i.e. the logits' bits) it gets alone, whatever starts, stops or is
cancelled beside it."""
from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest

from colibri_aio import Engine, EngineBusyError, SyncEngine, UserError
from colibri_aio.engine.batch import choose_slot
from colibri_aio.gguf.model import load
from support import fixture, main_in_process

MODEL = fixture("tiny_q8_0.gguf")
# Different prompts, lengths and sampling, so that a stream seeing another's state would show.
REQUESTS = [
    ("The list type", dict(max_tokens=14)),
    ("def f(x):", dict(max_tokens=9, temperature=0.8, seed=5)),
    ("Python is a programming language that lets you work quickly", dict(max_tokens=17)),
    ("import", dict(max_tokens=6, temperature=0.6, top_p=0.9, seed=11)),
    ("class A:", dict(max_tokens=11)),
]


async def _run(engine: Engine, prompt: str, options: dict, delay: float = 0.0) -> list[tuple[int, float]]:
    await asyncio.sleep(delay)
    return [(p.token, p.logprob) async for p in engine.generate(prompt, logprobs=1, **options)]


async def _alone(kernels: str, **placement) -> list[list[tuple[int, float]]]:
    async with await Engine.open(MODEL, io="pread", kernels=kernels, **placement) as engine:
        return [await _run(engine, p, o) for p, o in REQUESTS]


@pytest.mark.parametrize("kernels", ["ggml", "numpy"])
@pytest.mark.parametrize("cache_per_layer", [2, 64])
async def test_streams_decoded_together_equal_their_runs_alone(kernels: str, cache_per_layer: int) -> None:
    """Five streams on three slots (two wait for a slot), starting at different times: each one's tokens and
    log-probabilities equal its run alone on a one-sequence engine. 64 slots a layer hold every expert of the
    fixture (each step runs as one graph); 2 make every step read."""
    alone = await _alone(kernels, cache_per_layer=cache_per_layer)
    async with await Engine.open(MODEL, io="pread", kernels=kernels, cache_per_layer=cache_per_layer,
                                 parallel=3) as engine:
        together = await asyncio.gather(*(_run(engine, p, o, delay=0.002 * i) for i, (p, o) in enumerate(REQUESTS)))
        stats = engine.stats()
    assert together == alone
    assert stats.sequences_total == 3 and stats.sequences_busy == 0
    assert stats.batch_steps > 0 and stats.batch_rows_mean > 1.0
    if kernels == "ggml":
        assert 0 < stats.batch_union_mean <= 64


async def test_cancelling_one_stream_never_disturbs_the_others() -> None:
    alone = await _alone("ggml")
    async with await Engine.open(MODEL, io="pread", parallel=3) as engine:
        async def cancelled() -> None:
            async with contextlib.aclosing(engine.generate("def f(x):", max_tokens=40)) as stream:
                n = 0
                async for _ in stream:
                    n += 1
                    if n == 3:
                        return
        victim = asyncio.create_task(_run(engine, "class A:", dict(max_tokens=40)))
        kept = asyncio.gather(_run(engine, *REQUESTS[0]), _run(engine, *REQUESTS[2]), cancelled())
        await asyncio.sleep(0.01)
        victim.cancel()
        first, third, _ = await kept
        with pytest.raises(asyncio.CancelledError):
            await victim
        assert engine.stats().sequences_busy == 0
        # The slots are free again, and a later stream decodes as alone.
        again = await _run(engine, *REQUESTS[4])
    assert first == alone[0] and third == alone[2] and again == alone[4]


async def test_a_caller_that_will_not_wait_is_told_when_every_slot_is_taken() -> None:
    async with await Engine.open(MODEL, io="pread", parallel=2) as engine:
        streams = [engine.generate(p, max_tokens=20) for p in ("The list type", "Python")]
        for s in streams:
            await anext(s)
        with pytest.raises(EngineBusyError, match="2 sequence slots"):
            await anext(engine.generate("import", max_tokens=3, wait=False))
        with pytest.raises(EngineBusyError):
            await engine.logits([1, 2], wait=False)
        await streams[0].aclose()
        assert len([p async for p in engine.generate("import", max_tokens=3, wait=False)]) == 3
        await streams[1].aclose()


async def test_logits_on_a_parallel_engine_equal_a_single_ones() -> None:
    async with await Engine.open(MODEL, io="pread") as engine:
        ref = await engine.logits([1, 2, 3, 4, 5])
    async with await Engine.open(MODEL, io="pread", parallel=2) as engine:
        both = await asyncio.gather(engine.logits([1, 2, 3, 4, 5]), _run(engine, *REQUESTS[0]),
                                    engine.logits([1, 2, 3, 4, 5]))
    assert (both[0] == ref).all() and (both[2] == ref).all()


async def test_the_next_turn_of_a_chat_finds_its_slot() -> None:
    """A prompt that continues an earlier one goes to the slot that holds it, and prefills only the rest."""
    async with await Engine.open(MODEL, io="pread", parallel=2) as engine:
        first = [p async for p in engine.generate("The list type is", max_tokens=4)]
        other = [p async for p in engine.generate("def f(x):", max_tokens=4)]
        ids = engine.prompt_ids("The list type is") + [p.token for p in first[:-1]]
        follow = [p async for p in engine.generate(ids + [first[-1].token, 100], max_tokens=2)]
    assert other[-1].cached_tokens == 0
    assert follow[-1].cached_tokens == len(ids)


def test_choose_slot_prefers_the_longest_prefix_then_the_least_recently_used() -> None:
    held = [[1, 2, 3], [1, 2], [], [1, 2, 4, 4]]
    assert choose_slot([1, 2, 3, 9], held, [True, True, True, True], [3, 1, 0, 2]) == 0
    assert choose_slot([1, 2, 3, 9], held, [False, True, True, True], [3, 1, 0, 2]) == 1   # 2 shared, older
    assert choose_slot([7], held, [True, True, True, False], [3, 1, 2, 0]) == 1
    assert choose_slot([7], held, [False] * 4, [0] * 4) is None


def test_sync_engine_threads_decode_together() -> None:
    with SyncEngine.open(MODEL, io="pread") as engine:
        alone = [engine.text(p, **o) for p, o in REQUESTS[:3]]
    with SyncEngine.open(MODEL, io="pread", parallel=3) as engine:
        results: dict[int, str] = {}
        threads = [threading.Thread(target=lambda i=i, p=p, o=o: results.__setitem__(i, engine.text(p, **o)))
                   for i, (p, o) in enumerate(REQUESTS[:3])]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert engine.stats().batch_rows_mean > 1.0
    assert [results[i] for i in range(3)] == alone


async def test_a_parallel_that_does_not_fit_is_refused() -> None:
    with pytest.raises(UserError, match="--parallel must be >= 1"):
        await Engine.open(MODEL, io="pread", parallel=0)
    with pytest.raises(UserError, match=r"x 20000 sequences \(--parallel\)"):
        await Engine.open(MODEL, io="pread", ram_budget="1G", parallel=20000)


@pytest.mark.parametrize("value", ["0", "-2", "many"])
def test_a_bad_parallel_flag_is_one_line_and_exit_2(value: str) -> None:
    code, out, err = main_in_process("run", str(MODEL), "--parallel", value, "--prompt", "hi", "--max-tokens", "2")
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "--parallel" in err



async def test_a_long_prompt_is_prefilled_between_the_decode_steps_of_the_others(monkeypatch) -> None:
    """Chunked prefill: a prompt of several chunks that arrives while a stream decodes costs that stream at most
    one chunk between two of its steps (chunks of 16 positions here, to fit the fixture's context)."""
    import colibri_aio.engine.batch as batch

    monkeypatch.setattr(batch, "PREFILL_CHUNK", 16)
    async with await Engine.open(MODEL, io="pread", parallel=2) as engine:
        events: list[str] = []
        forward, decode_batch = engine.net.forward, engine.net.decode_batch

        async def logged_forward(ids, **kw):
            events.append(f"chunk{len(ids)}" if len(ids) > 1 else "one")
            return await forward(ids, **kw)

        async def logged_decode(rows):
            events.append(f"step{len(rows)}")
            return await decode_batch(rows)

        monkeypatch.setattr(engine.net, "forward", logged_forward)
        monkeypatch.setattr(engine.net, "decode_batch", logged_decode)
        first = engine.generate("The list type", max_tokens=60)
        await anext(first)
        await anext(first)                                  # decoding now
        long_prompt = list(range(5, 5 + 100))               # 7 chunks of 16 (the last of 4)
        late = asyncio.create_task(_run(engine, long_prompt, dict(max_tokens=3)))
        async for _ in first:
            pass
        await late
    started = events.index("step1")                         # the first stream decodes: its prompt is in
    chunks = [i for i, e in enumerate(events) if e.startswith("chunk") and i > started]
    assert [events[i] for i in chunks] == ["chunk16"] * 6 + ["chunk4"]
    # Between two chunks of the new prompt, the decoding stream took a step.
    assert all(any(e.startswith("step") for e in events[a + 1:b]) for a, b in zip(chunks, chunks[1:])), " ".join(events)



@pytest.mark.parametrize("name", ["tiny_f32", "gptoss_f32", "deepseek2_f32", "glm4moe_f32", "llama4_f32"])
async def test_a_step_whose_experts_are_all_resident_runs_as_one_graph_for_every_stream(name: str) -> None:
    """Every expert in the pool (fixtures whose experts sit alike in their slots, io_uring's one-stride pool),
    the one-graph path tried at every step: batched steps run as one graph, and each stream's tokens and
    log-probabilities are still those it gets alone."""
    from colibri_aio.policy.step_path import StepPathGuess

    model = fixture(f"{name}.gguf")
    vocab = load(model).args.vocab_size
    requests = [([5 + (7 * i + j) % (vocab - 10) for j in range(4 + 3 * i)], dict(max_tokens=6 + i)) for i in range(3)]
    placement = dict(io="uring", kernels="ggml", cache_per_layer=10**6, history=False)

    async def run(engine: Engine, ids: list[int], options: dict) -> list[tuple[int, float]]:
        return [(p.token, p.logprob) async for p in engine.generate(ids, logprobs=1, reuse=False, **options)]

    async with await Engine.open(model, **placement) as engine:
        alone = [await run(engine, ids, o) for ids, o in requests]
    async with await Engine.open(model, parallel=3, **placement) as engine:
        for ids, o in requests:                        # the experts these prompts route to are read once
            await run(engine, ids, o)
        engine.net.step_path = StepPathGuess(threshold=0.0)
        one_graph, batched = engine.net.one_graph_steps, engine.stats().batch_steps
        together = await asyncio.gather(*(run(engine, ids, o) for ids, o in requests))
        assert engine.net.one_graph_steps - one_graph > 0 and engine.stats().batch_steps > batched
        assert engine.stats().batch_union_mean > 0
        _assert_step_graphs_fit_their_room(engine)
    assert together == alone


def _assert_step_graphs_fit_their_room(engine: Engine) -> None:
    """The one-graph step's tensors fit the room decode_graphs gives a step of B rows without its fixed slack
    (so that a model of many more blocks than the fixture's never runs out of it: ggml aborts then)."""
    import ggml as G

    blocks = engine.model.args.block_count
    steps = [(key[2], g) for key, g in engine.net.decode_graphs()._graphs.items() if g is not None and key[0] == ("step",)]
    assert {rows for rows, _ in steps} >= {2, 3}
    for rows, graph in steps:
        room = (160 + 96 * (rows - 1)) * blocks
        given = room + 4096
        tensors = (G.ggml_used_mem(graph.ctx) - G.ggml_graph_overhead_custom(given, False)) / G.ggml_tensor_overhead()
        assert tensors <= room, (rows, tensors, room)
