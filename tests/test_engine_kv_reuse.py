"""KV-cache reuse: the engine keeps the ids behind its cache and prefills only what a new prompt adds.

Reuse must not change a bit: a request served from the cache gives exactly
the logits of the same forward calls run on a fresh engine. (Against a
*different* split of the same ids, such as one prefill of the whole prompt,
results agree only to float rounding: batched and one-token kernels sum in
different orders, as in llama.cpp.)
"""
from __future__ import annotations

import numpy as np
import pytest

from colibri_aio.engine.engine import Engine

from support import greedy_generation, greedy_replay

BIAS = {0: -100.0, 2: -100.0}  # no end-of-text: replies run their full length


async def _open() -> Engine:
    return await Engine.open(None, io="pread", cache_per_layer=8, prefetch="off")


async def _greedy(engine: Engine, ids: list[int], n: int, **kw) -> tuple[list[int], list[float], int]:
    return await greedy_generation(engine, ids, n, BIAS, **kw)


async def _replay(engine: Engine, calls: list[list[int] | int], n: int) -> tuple[list[int], list[float]]:
    return await greedy_replay(engine, calls, n, BIAS)


async def test_turn_two_prefills_only_the_new_tokens_and_matches_the_same_calls_bit_for_bit() -> None:
    async with await _open() as engine:
        p1 = engine.prompt_ids([{"role": "user", "content": "What is a list?"}])
        g1, _, cached1 = await _greedy(engine, p1, 6)
        assert cached1 == 0
        p2 = p1 + g1 + engine.tokenizer.encode("<|im_start|>user\nAnd a tuple?<|im_end|>\n<|im_start|>assistant\n")
        g2, lp2, cached2 = await _greedy(engine, p2, 6)
        # The cache held the first prompt and every generated token but the last (never run).
        assert cached2 == len(p1) + len(g1) - 1
        assert engine.stats().prompt_tokens_cached == cached2
        fresh = await _open()
        async with fresh:
            calls = [p1, *([t] for t in g1[:-1]), p2[cached2:]]  # what the reusing engine ran
            assert await _replay(fresh, calls, 6) == (g2, lp2)


async def test_a_prompt_that_diverges_rewinds_to_the_common_prefix() -> None:
    async with await _open() as engine:
        a = engine.prompt_ids("The list type is a sequence")
        b = engine.prompt_ids("The list type can hold anything")
        common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        await _greedy(engine, a, 20)  # the cache now runs well past the divergence
        g, lp, cached = await _greedy(engine, b, 5)
        assert cached == common
        assert engine.net.ids[:len(b)] == b and len(engine.net.ids) == engine.net.n_past
        async with await _open() as fresh:
            # The common prefix was computed within the first prompt's prefill: replay that, rewind, go on.
            assert await _replay(fresh, [a, common, b[common:]], 5) == (g, lp)


async def test_the_same_prompt_again_reruns_only_its_last_token() -> None:
    async with await _open() as engine:
        ids = engine.prompt_ids("The dict type")
        first = await _greedy(engine, ids, 4)
        second = await _greedy(engine, ids, 4)
        assert second[2] == len(ids) - 1
        assert second[0] == first[0]
        np.testing.assert_allclose(second[1], first[1], atol=1e-4)


async def test_reuse_off_prefills_everything_and_agrees_to_rounding() -> None:
    async with await _open() as engine:
        p1 = engine.prompt_ids("The list type")
        g1, _, _ = await _greedy(engine, p1, 8)
        p2 = p1 + g1 + engine.prompt_ids(" and the tuple")
        reused = await _greedy(engine, p2, 8)
        fresh = await _greedy(engine, p2, 8, reuse=False)
        assert reused[2] > 0 and fresh[2] == 0
        assert engine.stats().prompt_tokens_cached == reused[2]
        np.testing.assert_allclose(reused[1], fresh[1], atol=1e-3)


async def test_a_generation_stopped_early_leaves_a_consistent_cache() -> None:
    async with await _open() as engine:
        ids = engine.prompt_ids("The list type")
        stream = engine.generate(ids, max_tokens=50, logit_bias=BIAS)
        got = [p.token async for p, _ in zip_pieces(stream, 3)]
        await stream.aclose()
        assert engine.net.ids == ids + got[:-1] and engine.net.n_past == len(engine.net.ids)
        nxt = ids + got + engine.prompt_ids(" more")
        g, lp, cached = await _greedy(engine, nxt, 3)
        assert cached == len(ids) + len(got) - 1
        async with await _open() as fresh:
            calls = [ids, *([t] for t in got[:-1]), nxt[cached:]]
            assert await _replay(fresh, calls, 3) == (g, lp)


async def zip_pieces(stream, n: int):
    """The first n pieces of a stream, paired with their index."""
    i = 0
    async for p in stream:
        yield p, i
        i += 1
        if i == n:
            return


async def test_rewind_refuses_to_go_forward() -> None:
    async with await _open() as engine:
        await engine.net.forward([1, 2, 3])
        engine.net.rewind(1)
        assert engine.net.ids == [1] and engine.net.n_past == 1
        with pytest.raises(ValueError):
            engine.net.rewind(2)


async def test_a_generation_cancelled_mid_step_ends_with_no_read_in_flight() -> None:
    import asyncio

    async with await Engine.open(None, io="pread", cache_per_layer=2, prefetch="on") as engine:
        seen = []
        for _ in range(5):
            first = asyncio.Event()

            async def consume() -> None:
                async for _piece in engine.generate("The list type", max_tokens=50, logit_bias=BIAS):
                    first.set()

            task = asyncio.create_task(consume())
            await first.wait()
            await asyncio.sleep(0)   # the next step is under way: demand and prefetch reads in flight
            seen.append(engine.source.reader.in_flight)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            assert engine.source.reader.in_flight == 0
        assert any(seen), "no read was in flight when the generation was cancelled: nothing was tested"
