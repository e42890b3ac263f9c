"""One engine, one KV cache: concurrent callers queue (or are told it is busy) and never mix their streams;
a broken model stops generation with an error naming where."""
from __future__ import annotations

import asyncio
import contextlib
import shutil
import struct

import pytest

from colibri_aio import Engine, EngineBusyError, NonFiniteError, UserError
from colibri_aio.gguf.header import GGUFHeader
from support import fixture

MODEL = fixture("tiny_q8_0.gguf")
# Different prompts and sampling, so that interleaving would show in every one of them.
REQUESTS = [
    ("The list type", dict(max_tokens=12)),
    ("def f(x):", dict(max_tokens=9, temperature=0.8, seed=5)),
    ("Python", dict(max_tokens=15, temperature=0.6, top_p=0.9, seed=11)),
]


async def _tokens(engine: Engine, prompt: str, options: dict) -> list[int]:
    return [p.token async for p in engine.generate(prompt, **options)]


@pytest.mark.parametrize("cache_per_layer", [2, None])
async def test_concurrent_streams_equal_their_sequential_outputs(cache_per_layer: int | None) -> None:
    """asyncio.gather of three streams on one engine gives each the text it gets alone
    (a small cache once made the interleaved streams fight over slots)."""
    async with await Engine.open(MODEL, io="pread", cache_per_layer=cache_per_layer) as engine:
        alone = [await _tokens(engine, prompt, options) for prompt, options in REQUESTS]
        together = await asyncio.gather(*(_tokens(engine, p, o) for p, o in REQUESTS))
        again = await asyncio.gather(*(engine.logits([1, 2, 3]) for _ in range(2)), _tokens(engine, *REQUESTS[0]))
    assert together == alone
    assert (again[0] == again[1]).all() and again[2] == alone[0]


async def test_a_caller_that_will_not_wait_is_told_at_once() -> None:
    async with await Engine.open(MODEL, io="pread") as engine:
        first = engine.generate("The list type", max_tokens=20)
        await anext(first)                                   # the first stream holds the engine now
        with pytest.raises(EngineBusyError):
            await anext(engine.generate("Python", max_tokens=3, wait=False))
        with pytest.raises(EngineBusyError):
            await engine.logits([1, 2], wait=False)
        await first.aclose()                                 # closing the stream lets the next one in
        assert len(await _tokens(engine, "Python", dict(max_tokens=3, wait=False))) == 3


async def test_a_task_asking_again_inside_its_own_stream_is_told_instead_of_waiting_forever() -> None:
    async with await Engine.open(MODEL, io="pread") as engine:
        async with contextlib.aclosing(engine.generate("The list type", max_tokens=5)) as stream:
            async for _ in stream:
                with pytest.raises(EngineBusyError, match="own stream"):
                    await engine.logits([1, 2])
                break


async def test_a_waiting_caller_runs_when_the_first_stream_is_closed() -> None:
    async with await Engine.open(MODEL, io="pread") as engine:
        first = engine.generate("The list type", max_tokens=50)
        await anext(first)
        second = asyncio.create_task(_tokens(engine, "Python", dict(max_tokens=4)))
        await asyncio.sleep(0.05)
        assert not second.done()                             # queued behind the first stream
        async with contextlib.aclosing(first):
            pass
        assert len(await asyncio.wait_for(second, 30)) == 4


async def test_options_are_refused_before_any_work() -> None:
    async with await Engine.open(MODEL, io="pread") as engine:
        for bad in (dict(max_tokens=0), dict(seed=-1), dict(temperature=float("nan")), dict(top_p=2.0)):
            with pytest.raises(UserError):
                await anext(engine.generate("The list type", **bad))
        with pytest.raises(UserError, match="not valid UTF-8"):
            await anext(engine.generate("caf\udce9"))
        assert engine.prompt_tokens == 0                     # nothing was computed


def _nan_in(path, tensor: str, offset: int, value: bytes) -> None:
    t = next(t for t in GGUFHeader(path).tensors if t.name == tensor)
    with open(path, "r+b") as f:
        f.seek(t.data_offset + offset)
        f.write(value)


@pytest.mark.parametrize("tensor,value,where", [
    ("blk.0.attn_q.weight", struct.pack("<H", 0x7C00), "layer 0 attention"),          # +inf scale
    ("output_norm.weight", struct.pack("<f", float("nan")), "output head"),
    ("blk.1.ffn_gate_inp.weight", struct.pack("<f", float("nan")), "layer 1 router"),
])
async def test_non_finite_values_stop_generation_naming_where(tmp_path, tensor: str, value: bytes,
                                                              where: str) -> None:
    broken = tmp_path / "broken.gguf"
    shutil.copyfile(MODEL, broken)
    _nan_in(broken, tensor, 0, value)
    async with await Engine.open(broken, io="pread") as engine:
        with pytest.raises(NonFiniteError, match=where):
            [p async for p in engine.generate("The list type", max_tokens=8)]
