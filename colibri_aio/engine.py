"""The engine: a loaded model, its tokenizer and expert source, and the generation loop.

    async with await Engine.open("model.gguf") as engine:
        async for piece in engine.generate("The list type", max_tokens=32):
            print(piece.text, end="", flush=True)
"""
from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from colibri_aio.errors import UserError
from colibri_aio.experts import ExpertSource
from colibri_aio.gguf_model import Model, load
from colibri_aio.models import default_model_path
from colibri_aio.qwen3moe import Qwen3MoE
from colibri_aio.sampling import FinishReason, Stopper, make_sampler
from colibri_aio.plan import Plan
from colibri_aio.policy.budget import parse_size
from colibri_aio.sources import DEFAULT_LOOKAHEAD, Placement, open_source
from colibri_aio.tokenizer import Tokenizer

Prompt = str | Sequence[Mapping[str, Any]]
PREFILL_CHUNK = 256  # positions per prefill step: bounds activation memory, keeps batch-union wide


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

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        return self.generated_tokens / self.decode_seconds if self.decode_seconds else 0.0


class Engine:
    """A model ready to generate. Open with :meth:`open`; close with ``async with`` or :meth:`aclose`."""

    def __init__(self, model: Model, tokenizer: Tokenizer, source: ExpertSource, plan: Plan,
                 placement: Placement) -> None:
        self.model, self.tokenizer, self.source, self.plan, self.placement = model, tokenizer, source, plan, placement
        self.net = Qwen3MoE(model, source, plan.context)
        self.net.lookahead = None if placement.prefetch == "off" else DEFAULT_LOOKAHEAD

    @classmethod
    async def open(cls, path: str | os.PathLike[str] | None = None, *, io: str = "auto",
                   ram_budget: int | str | None = None, cache_per_layer: int | None = None,
                   prefetch: str = "auto", pin: str = "off", n_ctx: int | None = None) -> "Engine":
        """Load ``path`` (default: the shipped model) and open its expert source.

        Placement: ``io`` (auto|uring|pread|mmap), ``ram_budget`` (bytes or a
        size such as "12G"; default: a share of usable RAM), ``cache_per_layer``
        (expert slots per layer instead of a budget), ``prefetch``
        (auto|on|off), ``pin`` (auto|off|FILE), ``n_ctx`` (KV-cache positions).
        Placement changes speed, never tokens.
        """
        budget = parse_size(ram_budget) if isinstance(ram_budget, str) else ram_budget
        placement = Placement(io=io, ram_budget=budget, cache_per_layer=cache_per_layer, prefetch=prefetch,
                              pin=pin, context=n_ctx)
        placement.check()
        model = load(path if path is not None else default_model_path())
        tokenizer = Tokenizer.from_gguf(model.reader)
        if tokenizer.vocab_size != model.args.vocab_size:
            raise UserError(f"{model.path}: tokenizer has {tokenizer.vocab_size} tokens, model {model.args.vocab_size}")
        source, plan = await open_source(model, placement)
        return cls(model, tokenizer, source, plan, placement)

    def describe(self) -> str:
        """One line: model, plan, and the I/O backend with the reason it was chosen."""
        reader = getattr(self.source, "reader", None)
        io = f"io {reader.backend} ({reader.backend_reason})" if reader is not None else "io n/a"
        return f"{self.model.path.name}: {self.plan.one_line()}; {io}; prefetch {self.placement.prefetch}"

    async def __aenter__(self) -> "Engine":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.source.aclose()

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
        logits = None
        for start in range(0, len(ids), PREFILL_CHUNK):
            logits = await self.net.forward(ids[start: start + PREFILL_CHUNK])
        assert logits is not None
        return logits

    async def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Teacher-forced logits (len(ids), vocab): row i follows ids[0..i]."""
        self.net.reset()
        rows = [await self.net.forward(ids[s: s + PREFILL_CHUNK], logits="all")
                for s in range(0, len(ids), PREFILL_CHUNK)]
        return np.concatenate(rows, axis=0)

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
        t1 = time.perf_counter()
        while True:
            token = sample(logits)
            step = stopper.step(token)
            yield GenerationPiece(step.text, token, step.finish_reason, len(ids), stopper.n_tokens,
                                  t_prefill, time.perf_counter() - t1)
            if step.finish_reason is not None:
                return
            logits = await self.net.forward([token])
