"""The engine: a loaded model, its tokenizer and expert source, and the generation loop.

    async with await Engine.open("model.gguf") as engine:
        async for piece in engine.generate("The list type", max_tokens=32):
            print(piece.text, end="", flush=True)
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from colibri_aio.errors import UserError
from colibri_aio.gguf.model import Model, Progress, load
from colibri_aio.kernels.backend import NAMES as KERNEL_NAMES, Kernels, KernelsUnavailable, open_kernels
from colibri_aio.kernels.threads import limit_blas_threads
from colibri_aio.engine.memory import peak_rss_bytes, rss_bytes
from colibri_aio.policy.diskstats import DiskstatsSampler, device_of, read_diskstats
from colibri_aio.models import default_model_path
from colibri_aio.arch.qwen3moe import Qwen3MoE
from colibri_aio.text.sampling import FinishReason, Stopper, make_sampler
from colibri_aio.engine.plan import Plan
from colibri_aio.policy.budget import parse_size
from colibri_aio.engine.scheduler import CachedExpertSource
from colibri_aio.engine.placement import DEFAULT_LOOKAHEAD, Placement, open_source
from colibri_aio.engine.stats import EngineStats
from colibri_aio.text.tokenizer import Tokenizer

Prompt = str | Sequence[Mapping[str, Any]]


@dataclass(frozen=True, slots=True)
class GenerationPiece:
    """One step of a generation stream: new text, the token that made it, and timing so far."""

    text: str
    token: int | None
    finish_reason: FinishReason | None
    prompt_tokens: int
    generated_tokens: int
    prefill_seconds: float
    decode_seconds: float
    stats: EngineStats

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        return self.generated_tokens / self.decode_seconds if self.decode_seconds else 0.0


def _open_kernels(name: str | None) -> Kernels:
    """The engine's own kernel backend (``name``, else $COLIBRI_KERNELS, else auto); a backend
    asked for by name that cannot run here is a user error."""
    name = name if name is not None else os.environ.get("COLIBRI_KERNELS", "auto")
    if name not in KERNEL_NAMES:
        raise UserError(f"unknown kernels {name!r} (choose from {', '.join(KERNEL_NAMES)})")
    try:
        kernels = open_kernels(name)
    except KernelsUnavailable as e:
        raise UserError(f"--kernels {name}: {e}") from None
    # The kernels use the cores themselves; OpenBLAS threads inside NumPy calls would
    # oversubscribe them (evidence/kernels_20261129T181438Z.md: f32 GEMV 2.83 vs 0.24
    # G weights/s median with one OpenBLAS thread vs its default, same run).
    limit_blas_threads(1)
    return kernels


class Engine:
    """A model ready to generate. Open with :meth:`open`; close with ``async with`` or :meth:`aclose`."""

    def __init__(self, model: Model, tokenizer: Tokenizer, source: CachedExpertSource, plan: Plan,
                 placement: Placement, kernels: Kernels) -> None:
        self.model, self.tokenizer, self.source, self.plan, self.placement = model, tokenizer, source, plan, placement
        self.kernels = kernels
        self.net = Qwen3MoE(model, source, plan.context, kernels)
        self.net.lookahead = None if placement.prefetch == "off" else DEFAULT_LOOKAHEAD
        self.prompt_tokens = self.generated_tokens = 0
        self.prefill_s = self.decode_s = 0.0
        self.device = device_of(model.path)
        self._monitor: asyncio.Task[None] | None = None

    @classmethod
    async def open(cls, path: str | os.PathLike[str] | None = None, *, io: str = "auto",
                   ram_budget: int | str | None = None, cache_per_layer: int | None = None,
                   prefetch: str = "auto", pin: str = "off", n_ctx: int | None = None,
                   kernels: str | None = None, progress: Progress | None = None) -> "Engine":
        """Load ``path`` (default: the shipped model) and open its expert source.

        Placement: ``io`` (auto|uring|pread|mmap), ``ram_budget`` (bytes or a
        size such as "12G"; default: a share of usable RAM), ``cache_per_layer``
        (expert slots per layer instead of a budget), ``prefetch``
        (auto|on|off), ``pin`` (auto|off|FILE), ``n_ctx`` (KV-cache positions).
        Placement changes speed, never tokens. ``kernels`` (auto|ggml|numpy;
        default: $COLIBRI_KERNELS or auto) picks this engine's matrix kernels;
        backends differ in their rounding, so compare runs within one.
        ``progress(step, done, total)`` hears about the long steps (loading the
        trunk, the pool, pinning).
        """
        budget = parse_size(ram_budget) if isinstance(ram_budget, str) else ram_budget
        placement = Placement(io=io, ram_budget=budget, cache_per_layer=cache_per_layer, prefetch=prefetch,
                              pin=pin, context=n_ctx)
        placement.check()
        kernels = _open_kernels(kernels)
        try:
            model = load(path if path is not None else default_model_path(), progress=progress)
            tokenizer = Tokenizer.from_gguf(model.reader)
            if tokenizer.vocab_size != model.args.vocab_size:
                raise UserError(f"{model.path}: tokenizer has {tokenizer.vocab_size} tokens, "
                                f"model {model.args.vocab_size}")
            source, plan = await open_source(model, placement, progress)
        except BaseException:
            kernels.close()
            raise
        engine = cls(model, tokenizer, source, plan, placement, kernels)
        if engine.device is not None and placement.prefetch == "auto":
            engine._monitor = asyncio.get_running_loop().create_task(engine._watch_device())
        return engine

    def describe(self) -> str:
        """One line: model, plan, and the I/O backend with the reason it was chosen."""
        reader, cache = self.source.reader, self.source.cache
        return (f"{self.model.path.name}: {self.plan.one_line()}; cache {cache.n_slots} slots {cache.scope} "
                f"{cache.policy} ({len(cache.pinned)} pinned); io {reader.backend} ({reader.backend_reason}); "
                f"prefetch {self.placement.prefetch}; kernels {self.kernels.name} ({self.kernels.reason})")

    def stats(self) -> EngineStats:
        """The engine's counters now: tokens and their time, cache hits, reads, prefetch state, memory."""
        src = self.source
        cache, reader, bp = src.cache.stats, src.reader.stats, src.backpressure
        score = src.predictor.score
        return EngineStats(
            t=time.perf_counter(), prompt_tokens=self.prompt_tokens, generated_tokens=self.generated_tokens,
            prefill_s=self.prefill_s, decode_s=self.decode_s,
            pinned_hits=cache.pinned_hits, cached_hits=cache.cached_hits, prefetch_hits=cache.prefetch_hits,
            misses=cache.misses, prefetch_reads=cache.prefetch_reads, prefetch_wasted=cache.prefetch_wasted,
            prefetch_wasted_bytes=cache.prefetch_wasted * self.model.expert_nbytes_max,
            prefetch_on=bp.prefetch_on and self.net.lookahead is not None,
            prefetch_reason=bp.reason if self.net.lookahead is not None else "lookahead off",
            lookahead_recall=score.recall, lookahead_precision=score.precision,
            bytes_read=reader.bytes, io_bytes=reader.io_bytes, reads_in_flight=src.reader.in_flight,
            slots_used=len(src.cache), slots_total=src.cache.n_slots, read_busy_s=reader.busy_s,
            rss=rss_bytes(), peak_rss=peak_rss_bytes())

    async def _watch_device(self, period: float = 0.25) -> None:
        """Feed the backpressure controller iostat-style samples of the model's device."""
        assert self.device is not None
        sampler = DiskstatsSampler(self.device)
        while True:
            sample = sampler.sample(read_diskstats(), time.perf_counter())
            if sample is not None:
                self.source.backpressure.device(sample)
            await asyncio.sleep(period)

    async def __aenter__(self) -> "Engine":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop the device watch, drain every read in flight, release the pool and the kernels."""
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
            self._monitor = None
        try:
            await self.source.aclose()
        finally:
            self.kernels.close()

    def prompt_ids(self, prompt: Prompt, *, chat: bool = False) -> list[int]:
        """Token ids of a prompt: plain text, or chat messages rendered with the model's template."""
        if not isinstance(prompt, str):
            text = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True)
        elif chat:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        else:
            text = prompt
        ids = self.tokenizer.encode(text, parse_special=True, add_special=True)
        if not ids:
            raise UserError("the prompt is empty")
        return ids

    async def prefill(self, ids: Sequence[int]) -> np.ndarray:
        """Run ``ids`` from an empty context; return the logits after the last one."""
        self.net.reset()
        return await self.net.prefill(ids)

    async def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Teacher-forced logits (len(ids), vocab): row i follows ids[0..i]."""
        self.net.reset()
        return await self.net.prefill(ids, logits="all")

    async def generate(self, prompt: Prompt, *, chat: bool = False, max_tokens: int = 128,
                       temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                       seed: int | None = None, stop: Sequence[str] = ()) -> AsyncIterator[GenerationPiece]:
        """Stream a continuation of ``prompt`` piece by piece; the last piece carries ``finish_reason``."""
        ids = self.prompt_ids(prompt, chat=chat)
        budget = self.net.n_ctx - len(ids)
        if budget < 1:
            raise UserError(f"the prompt has {len(ids)} tokens; the context holds {self.net.n_ctx}")
        sample = make_sampler(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
        stopper = Stopper(self.tokenizer.stream_decoder(skip_special=True), self.tokenizer.is_eog,
                          max_tokens=min(max_tokens, budget), stop=stop)
        t0 = time.perf_counter()
        logits = await self.prefill(ids)
        t_prefill = time.perf_counter() - t0
        self.prompt_tokens += len(ids)
        self.prefill_s += t_prefill
        t1 = tick = time.perf_counter()
        while True:
            token = sample(logits)
            step = stopper.step(token)
            self.generated_tokens += 1
            now = time.perf_counter()
            self.decode_s += now - tick
            yield GenerationPiece(step.text, token, step.finish_reason, len(ids), stopper.n_tokens,
                                  t_prefill, now - t1, self.stats())
            if step.finish_reason is not None:
                return
            tick = time.perf_counter()
            logits = await self.net.forward([token])
