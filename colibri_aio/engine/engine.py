"""The engine: a loaded model, its tokenizer and expert source, and the generation loop.

    async with await Engine.open("model.gguf") as engine:
        async for piece in engine.generate("The list type", max_tokens=32):
            print(piece.text, end="", flush=True)

By default an engine holds one KV cache, so it computes for one caller at a
time: ``generate``, ``logits`` and ``prefill`` called concurrently (several
tasks, ``asyncio.gather``, several threads through
:class:`~colibri_aio.SyncEngine`) queue behind each other in call order, or,
with ``wait=False``, fail at once with
:class:`~colibri_aio.errors.EngineBusyError`. Opened with ``parallel=N`` it
holds N sequences and decodes up to N streams together, one decode step for
all of them (:mod:`colibri_aio.engine.batch`); the (N+1)th caller queues or
fails the same way. A stream holds its place from its first piece until it
ends or is closed: leave an ``async for`` early inside
``contextlib.aclosing(...)`` (or close the stream) so the next caller does
not wait for the garbage collector.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from colibri_aio.errors import EngineBusyError, UserError
from colibri_aio.gguf.model import Model, Progress
from colibri_aio.kernels.backend import Kernels
from colibri_aio.engine.memory import peak_rss_bytes, rss_bytes
from colibri_aio.engine.device import DeviceMonitor
from colibri_aio.models import default_model_path
from colibri_aio.arch.kvcache import DEFAULT_KV_TYPE
from colibri_aio.arch import build_net
from colibri_aio.text.sampling import SamplingParams, TokenConstraint, TokenPicker, check_generation_options
from colibri_aio.engine.plan import Plan, gb
from colibri_aio.policy.budget import parse_size
from colibri_aio.engine.scheduler import CachedExpertSource
from colibri_aio.engine.batch import Batcher, cached_prefix
from colibri_aio.engine.slot_file import restore_slot, save_slot
from colibri_aio.gguf.fingerprint import model_fingerprint
from colibri_aio.engine.history import HistoryFile
from colibri_aio.engine.opening import OpenTimings, open_parts
from colibri_aio.engine.placement import Placement
from colibri_aio.engine.stats import EngineStats
from colibri_aio.engine.streams import Decoding, GenerationPiece
from colibri_aio.engine.tasks import EngineTasks
from colibri_aio.logs import get_logger
from colibri_aio.settings import Settings
from colibri_aio.text.tokenizer import Tokenizer

Prompt = str | Sequence[Mapping[str, Any]] | Sequence[int]  # text, chat messages or token ids

log = get_logger("colibri_aio.engine")


class Engine:
    """A model ready to generate. Open with :meth:`open`; close with ``async with`` or :meth:`aclose`."""

    def __init__(self, model: Model, tokenizer: Tokenizer, source: CachedExpertSource, plan: Plan,
                 placement: Placement, kernels: Kernels, history: HistoryFile | None = None,
                 tasks: EngineTasks | None = None, settings: Settings | None = None) -> None:
        """The parts :meth:`open` made; ``tasks``: the group its background work runs in (closed with the
        engine); ``settings``: the switches it was opened with (None: read now)."""
        self.model, self.tokenizer, self.source, self.plan, self.placement = model, tokenizer, source, plan, placement
        self.kernels, self.history, self._tasks = kernels, history, tasks
        self.settings = settings if settings is not None else Settings.read()
        self.net = build_net(model, source, plan.context, kernels, plan.kv_type, self.settings, plan.parallel)
        self.net.lookahead = placement.lookahead
        self.prompt_tokens = self.generated_tokens = self.cached_tokens = 0
        self.prefill_s = self.decode_s = 0.0
        # One sampler of the model's device per engine: it feeds the backpressure controller,
        # and telemetry reads the same counters.
        self.device = DeviceMonitor.for_path(model.path, source.policy.on_device)
        self._turn = asyncio.Lock()  # one caller at a time on the KV cache
        self._holder: asyncio.Task[Any] | None = None  # the task whose turn it is
        self._closed = False
        self.open_timings: OpenTimings | None = None  # what each step of open took (set by open)
        self._fingerprint: str | None = None
        # Several sequences: their slots and the task that decodes them together (None: one caller at a time).
        self.batcher: Batcher | None = None
        if plan.parallel > 1:
            if tasks is None:
                raise ValueError("an engine of several sequences needs its tasks (Engine.open makes them)")
            self.batcher = Batcher(self, self.net)
            tasks.spawn(self.batcher.run(), name="decode steps")

    @classmethod
    async def open(cls, path: str | os.PathLike[str] | None = None, *, io: str = "auto",
                   ram_budget: int | str | None = None, cache_per_layer: int | None = None,
                   prefetch: str = "auto", pin: str = "off", n_ctx: int | None = None, kv_type: str = DEFAULT_KV_TYPE,
                   kernels: str | None = None, progress: Progress | None = None,
                   history: bool = True, warm_start: bool = True, read_ahead: bool = True,
                   parallel: int = 1, settings: Settings | None = None) -> "Engine":
        """Load ``path`` (default: the shipped model) and open its expert source.

        Placement: ``io`` (auto|uring|pread|mmap), ``ram_budget`` (bytes or a
        size such as "12G"; default: a share of usable RAM), ``cache_per_layer``
        (expert slots per layer instead of a budget), ``prefetch``
        (auto|on|off), ``pin`` (auto|off|FILE), ``n_ctx`` (KV-cache positions;
        default min(the model's context, 4096); more than the model's is
        clamped with a warning), ``kv_type`` (f16|f32: how keys and values are
        stored; f16 halves the KV cache, as in llama.cpp). Placement changes
        speed, never tokens. ``kernels`` (auto|ggml|numpy;
        default: $COLIBRI_KERNELS or auto) picks this engine's matrix kernels;
        backends differ in their rounding, so compare runs within one.
        ``progress(step, done, total)`` hears about the long steps (loading the
        trunk, loading the kernels, the pool, pinning), which run side
        by side (:mod:`colibri_aio.engine.opening`); ``open_timings`` has what
        each one took. ``history``:
        read and update this model's usage history (a cache file under
        ``$XDG_CACHE_HOME/colibri_aio/usage``; False: neither read nor write it).
        ``warm_start``: stream experts into the expert cache in the background,
        from when the trunk is read, never during a prompt (whose read-ahead
        has the disk) and behind every read the model waits for: all of them
        when they fit, else the ones a long enough usage history uses most
        (``plan.warm_start`` says which); on by default: the first token comes
        no later and the first decoded tokens miss less (evidence/first_token_*).
        ``read_ahead``: while a prefill computes one layer, read the experts
        the next one will likely use (:mod:`colibri_aio.policy.scheduler`), and
        issue reads from io_uring's kernel workers so that compute goes on while
        they fault in the pool pages they fill; on by default: its A/B shortened
        the time to first token on the 8- and 48-layer files and kept the first
        decoded tokens at the steady rate (evidence/first_token_20261202T01*).
        ``parallel``: sequences held at once, each with its own KV cache of
        ``n_ctx`` positions (the plan reserves them all, and refuses a number
        that does not fit): up to that many ``generate`` calls decode together,
        each step reading every layer's experts once for all of them.
        ``settings``: the environment's switches (:mod:`colibri_aio.settings`), read once here when not given,
        and handed to everything the engine builds.
        """
        settings = settings if settings is not None else Settings.read()
        budget = parse_size(ram_budget) if isinstance(ram_budget, str) else ram_budget
        placement = Placement(io=io, ram_budget=budget, cache_per_layer=cache_per_layer, prefetch=prefetch,
                              pin=pin, context=n_ctx, kv_type=kv_type, warm_start=warm_start,
                              read_ahead=read_ahead, parallel=parallel)
        tasks = await EngineTasks.start()
        try:
            model, tokenizer, source, plan, store, opened_kernels, timings = await open_parts(
                path if path is not None else default_model_path(), placement, tasks, settings=settings,
                kernels=kernels, progress=progress, history=history)
        except BaseException as exc:
            await tasks.aclose(raising=exc)
            raise
        for note in plan.notes:
            log.warning(note)
        try:
            engine = cls(model, tokenizer, source, plan, placement, opened_kernels, store, tasks, settings)
        except BaseException as exc:  # the net refused the model: nothing opened for it stays open
            await tasks.aclose(raising=exc)
            try:
                await source.aclose()
            finally:
                opened_kernels.close()
            raise
        engine.open_timings = timings
        log.info(engine.describe(full=True))
        if engine.device is not None:
            tasks.spawn(engine.device.run(), name="device monitor")
        return engine

    def describe(self, *, full: bool = False) -> str:
        """One line: model, memory, cache, I/O backend, prefetch and kernels.

        ``full`` adds the whole plan and the reasons the I/O backend and the
        kernels were chosen (a few hundred characters).
        """
        a, plan, reader, cache = self.model.args, self.plan, self.source.reader, self.source.policy.cache
        packing = self.source.packing
        copies = packing is not None and packing.mapped and not packing.prepacked
        parts = len(self.model.paths)
        line = (f"{self.model.path.name}{f' (+{parts - 1} parts)' if parts > 1 else ''}: "
                f"{a.layers_text} x {a.expert_count} experts of "
                f"{gb(plan.expert_nbytes)}; KV {gb(plan.kv_cache)} {plan.kv_type} for {plan.context} ctx"
                f"{f' x {plan.parallel} sequences' if plan.parallel > 1 else ''}; "
                + (f"experts in the page cache ({plan.experts_total} = {gb(plan.experts_nbytes)}"
                   f"{', repacked into copies that leave it' if copies else ''}); "
                   if reader.pool is None else
                   f"cache {cache.n_slots} slots ({len(cache.pinned)} pinned) = {gb(cache.n_slots * plan.slot_nbytes)}; ")
                + ("experts read repacked from the repack file; " if packing is not None and packing.prepacked else "")
                + f"io {reader.backend}; prefetch {self.placement.prefetch}; kernels {self.kernels.name}")
        if not full:
            return line
        packed = self.net.repacked_nbytes      # copies beside the trunk, outside the plan's budget
        return (f"{line}; {plan.one_line()}; cache {cache.scope} {cache.policy}; io {reader.backend_reason}; "
                f"kernels {self.kernels.reason}" + (f"; {gb(packed)} of trunk repacked" if packed else ""))

    def stats(self) -> EngineStats:
        """The engine's counters now: tokens and their time, cache hits, reads, prefetch state, memory."""
        src, policy = self.source, self.source.policy
        cache, reader = policy.cache.stats, src.reader.stats
        score = policy.predictor.score
        return EngineStats(
            t=time.perf_counter(), prompt_tokens=self.prompt_tokens, generated_tokens=self.generated_tokens,
            prompt_tokens_cached=self.cached_tokens,
            prefill_s=self.prefill_s, decode_s=self.decode_s,
            pinned_hits=cache.pinned_hits, cached_hits=cache.cached_hits, prefetch_hits=cache.prefetch_hits,
            misses=cache.misses, prefetch_reads=cache.prefetch_reads, prefetch_wasted=cache.prefetch_wasted,
            prefetch_wasted_bytes=cache.prefetch_wasted * self.model.expert_nbytes_max,
            prefetch_on=policy.prefetch_on, prefetch_reason=policy.prefetch_reason,
            lookahead_recall=score.recall, lookahead_precision=score.precision,
            bytes_read=reader.bytes, io_bytes=reader.io_bytes, reads_in_flight=src.reader.in_flight,
            slots_used=len(policy.cache), slots_total=policy.cache.n_slots, read_busy_s=reader.busy_s,
            rss=rss_bytes(), peak_rss=peak_rss_bytes(), **self._batch_stats())

    def _batch_stats(self) -> dict[str, Any]:
        b = self.batcher
        if b is None:
            busy = int(self._turn.locked())
            return dict(sequences_busy=busy, sequences_total=1)
        st = b.stats
        return dict(sequences_busy=b.busy, sequences_total=b.n_slots, batch_steps=st.steps, batch_rows=st.rows,
                    batch_last_rows=st.last_rows, batch_union=st.union_sum, batch_union_blocks=st.union_count)

    async def __aenter__(self) -> "Engine":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop the background tasks (the device watch), drain every read in flight, release the pool, save
        the usage history, release the kernels.

        Closing twice is harmless. Saving never raises: a history that cannot
        be written is one warning. A background task that failed is raised
        here, after everything is released.
        """
        if self._closed:
            return
        self._closed = True
        try:
            if self._tasks is not None:
                await self._tasks.aclose()
        finally:
            await self._release()

    async def _release(self) -> None:
        try:
            await self.source.aclose()
            if self.history is not None and self.source.policy.usage is not None:
                # A thread: the save may wait (a bounded time) for another run's lock on the folder.
                try:
                    await asyncio.to_thread(self.history.save, self.source.policy.usage)
                except RuntimeError:  # closed at interpreter exit: no new threads then, so on this one
                    self.history.save(self.source.policy.usage)
        finally:
            self.kernels.close()

    def prompt_ids(self, prompt: Prompt, *, chat: bool = False,
                   template_vars: Mapping[str, Any] | None = None) -> list[int]:
        """Token ids of a prompt: plain text, chat messages rendered with the model's template (``template_vars``:
        more variables for it, e.g. ``tools``, ``enable_thinking``), or ids as given."""
        if not isinstance(prompt, str) and prompt and all(isinstance(t, (int, np.integer)) for t in prompt):
            ids = [int(t) for t in prompt]  # type: ignore[arg-type]
            if min(ids) < 0 or max(ids) >= self.model.args.vocab_size:
                raise UserError(f"token id out of range [0, {self.model.args.vocab_size})")
            return ids
        if not isinstance(prompt, str):
            return self.text_ids(self.render_chat(prompt, template_vars), templated=True)  # type: ignore[arg-type]
        if chat:
            return self.text_ids(self.render_chat([{"role": "user", "content": prompt}], template_vars), templated=True)
        return self.text_ids(prompt)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], template_vars: Mapping[str, Any] | None = None) -> str:
        """Chat messages rendered with the model's template, ending with the assistant's generation prompt."""
        return self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, **(template_vars or {}))

    def text_ids(self, text: str, *, templated: bool = False) -> list[int]:
        """Token ids of ``text``; ``templated``: it came from the chat template (which may have written BOS)."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # lone surrogates: bytes from argv or a file that were not UTF-8
            raise UserError(f"the prompt is not valid UTF-8 (at character {exc.start})") from None
        ids = self.tokenizer.encode(text, parse_special=True, add_special=True)
        bos = self.tokenizer.bos_id
        if templated and ids[:2] == [bos, bos]:
            ids = ids[1:]  # the template wrote BOS itself (Mixtral's, Llama 2's): one is the model's input
        if not ids:
            raise UserError("the prompt is empty")
        return ids

    @contextlib.asynccontextmanager
    async def turn(self, *, wait: bool = True) -> AsyncIterator[None]:
        """Hold the engine (its KV cache) for one caller; others queue, or fail at once without ``wait``."""
        self._check_open()
        if self.batcher is not None:
            raise RuntimeError("an engine of several sequences has no single turn: use generate, logits or prefill")
        if self._turn.locked() and self._holder is asyncio.current_task():
            raise EngineBusyError("this task's own stream holds the engine: finish or close it first")
        if not wait and self._turn.locked():
            raise EngineBusyError("the engine is generating for another caller (wait=True queues behind it)")
        async with self._turn:
            self._holder = asyncio.current_task()
            try:
                yield
            finally:
                self._holder = None

    async def save_slot(self, path: str | os.PathLike[str], slot: int = 0, *, wait: bool = True) -> int:
        """Write sequence slot ``slot``'s KV cache, its token ids and the model's identity to ``path``; returns
        the bytes written. The slot must not be generating (with a parallel engine: no stream holds it)."""
        async with self._slot_turn(slot, wait):
            return await asyncio.to_thread(save_slot, self.net, slot, path, self.fingerprint)

    async def restore_slot(self, path: str | os.PathLike[str], slot: int = 0, *, wait: bool = True) -> int:
        """Fill sequence slot ``slot`` from a file :meth:`save_slot` wrote; returns the positions restored. A
        prompt that begins with them then prefills only the rest, and its logits equal the original's bit for
        bit. A file of another model, context size or KV type is refused (:class:`UserError`)."""
        async with self._slot_turn(slot, wait):
            return await asyncio.to_thread(restore_slot, self.net, slot, path, self.fingerprint)

    @property
    def fingerprint(self) -> str:
        """The model's identity in slot files: a digest of its GGUF header and size."""
        if self._fingerprint is None:
            self._fingerprint = model_fingerprint(self.model)
        return self._fingerprint

    @contextlib.asynccontextmanager
    async def _slot_turn(self, slot: int, wait: bool) -> AsyncIterator[None]:
        """Sole use of sequence slot ``slot`` and of the net, for a save or a restore."""
        if not 0 <= slot < len(self.net.slots):
            raise UserError(f"no slot {slot}: the engine holds {len(self.net.slots)} (--parallel)")
        if self.batcher is None:
            async with self.turn(wait=wait):
                yield
            return
        self._check_open()
        if not self.batcher.free[slot]:
            raise EngineBusyError(f"slot {slot} is generating: save or restore it once its stream ends")
        async with self.batcher.lock:
            if not self.batcher.free[slot]:
                raise EngineBusyError(f"slot {slot} is generating: save or restore it once its stream ends")
            yield

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is closed")

    async def prefill(self, ids: Sequence[int], *, wait: bool = True) -> np.ndarray:
        """Run ``ids`` from an empty context; return the logits after the last one."""
        if self.batcher is not None:
            self._check_open()
            return await self.batcher.teacher_forced(ids, "last", wait=wait)
        async with self.turn(wait=wait):
            self.net.reset()
            return await self.net.prefill(ids)

    async def logits(self, ids: Sequence[int], *, wait: bool = True) -> np.ndarray:
        """Teacher-forced logits (len(ids), vocab): row i follows ids[0..i]."""
        if self.batcher is not None:
            self._check_open()
            return await self.batcher.teacher_forced(ids, "all", wait=wait)
        async with self.turn(wait=wait):
            self.net.reset()
            return await self.net.prefill(ids, logits="all")

    def cached_prefix(self, ids: Sequence[int]) -> int:
        """How many leading ``ids`` the KV cache already holds and can continue from, short of the last (its
        logits start generation). 0 when the common prefix ends before what a sliding window still holds."""
        return cached_prefix(self.net, ids)

    async def generate(self, prompt: Prompt, *, chat: bool = False, max_tokens: int | None = 128,
                       stop: Sequence[str] = (), logprobs: int | None = None, reuse: bool = True,
                       wait: bool = True, sampling: SamplingParams | None = None,
                       constraint: TokenConstraint | None = None, special: bool = False,
                       **options: Any) -> AsyncIterator[GenerationPiece]:
        """Stream a continuation of ``prompt`` piece by piece; the last piece carries ``finish_reason``.

        ``prompt``: text, chat messages, or token ids. ``max_tokens``: None runs
        to the end of the context. Sampling: ``sampling`` and/or its fields as
        keywords (``temperature``, ``top_k``, ``top_p``, ``min_p``, ``seed``,
        ``repeat_penalty``, ``presence_penalty``, ``frequency_penalty``,
        ``penalty_last_n``, ``logit_bias``); the default is greedy.
        ``logprobs=n``: each piece carries its token's log-probability under
        the model's logits and the n most likely alternatives. ``reuse``: keep
        the longest prefix of the prompt the KV cache already holds and prefill
        only the rest (see ``cached_tokens``): the same bits as running the same
        forward calls afresh. ``constraint``: a
        :class:`~colibri_aio.text.sampling.TokenConstraint` (a grammar) that
        masks every pick. ``special``: pieces show special tokens' text (tool-call
        and channel markers), not only plain text.

        ``finish_reason`` is "stop" (an end-of-generation token or a stop
        string) or "length": ``max_tokens`` reached, or the context is full
        (then ``generated_tokens`` < ``max_tokens``). Concurrent calls queue
        behind each other (see the module's docstring) unless the engine holds
        several sequences (``parallel``): then up to that many decode together;
        ``wait=False`` raises :class:`~colibri_aio.errors.EngineBusyError`
        instead of queueing.
        """
        params = replace(sampling or SamplingParams(), **options)
        check_generation_options(max_tokens=max_tokens, sampling=params, vocab_size=self.model.args.vocab_size)
        ids = self.prompt_ids(prompt, chat=chat)
        budget = self.net.n_ctx - len(ids)
        if budget < 1:
            raise UserError(f"the prompt has {len(ids)} tokens; the context holds {self.net.n_ctx} "
                            f"(--ctx / n_ctx, at most the model's {self.model.args.context_length})")
        limit = budget if max_tokens is None else min(max_tokens, budget)
        if self.batcher is not None:
            self._check_open()
            stream = self.batcher.generate(ids, limit, stop, TokenPicker(params, ids, constraint), logprobs, reuse,
                                           wait=wait, special=special)
            async with contextlib.aclosing(stream):
                async for piece in stream:
                    yield piece
            return
        async with self.turn(wait=wait):
            stream = self._generate(ids, limit, stop, TokenPicker(params, ids, constraint), logprobs, reuse,
                                    special)
            try:
                async with contextlib.aclosing(stream):
                    async for piece in stream:
                        yield piece
            finally:
                await self.source.settle()  # the turn ends with no read in flight, however the stream ended

    async def _generate(self, ids: list[int], max_tokens: int, stop: Sequence[str], pick: TokenPicker,
                        logprobs: int | None, reuse: bool, special: bool) -> AsyncIterator[GenerationPiece]:
        cached = self.cached_prefix(ids) if reuse else 0
        t0 = time.perf_counter()
        self.net.rewind(cached)
        logits = await self.net.prefill(ids[cached:])
        self.net.checkpoint()   # a recurrent state cannot be wound back: keep the prompt's for the next turn
        t_prefill = time.perf_counter() - t0
        self.count_prompt(len(ids) - cached, cached, t_prefill)
        tick = time.perf_counter()

        def tally() -> EngineStats:   # the token's time: from the forward call (or the prefill's end) to its piece
            self.generated_tokens += 1
            self.decode_s += time.perf_counter() - tick
            return self.stats()

        decoding = Decoding(self.tokenizer, ids, max_tokens, stop, pick, logprobs, cached, t_prefill, tally,
                            special=special)
        while True:
            piece = decoding.piece(logits)
            yield piece
            if piece.finish_reason is not None:
                return
            tick = time.perf_counter()
            # A token whose experts all hit never suspends: give the loop a turn for what waits on it
            # (signal handlers, reads that landed, an HTTP server's other requests).
            await asyncio.sleep(0)
            logits = await self.net.forward([piece.token])

    def count_prompt(self, prefilled: int, cached: int, seconds: float) -> None:
        """A prompt is in: ``prefilled`` tokens computed in ``seconds``, ``cached`` found in the KV cache."""
        self.prompt_tokens += prefilled
        self.cached_tokens += cached
        self.prefill_s += seconds

    def count_token(self) -> EngineStats:
        """One more generated token (its time is counted by the step that made it); the counters now."""
        self.generated_tokens += 1
        return self.stats()
