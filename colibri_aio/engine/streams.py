"""One generation stream's side of decoding: from each row of logits, its token, its text and its piece.

The engine's single-sequence loop and the batcher's decode step
(:mod:`colibri_aio.engine.batch`) both hand every row of logits a stream
gets to its :class:`Decoding`, so a stream picks, stops and reports the same
way whether it decodes alone or beside others.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from colibri_aio.engine.stats import EngineStats
from colibri_aio.text.sampling import FinishReason, Stopper, TokenPicker, log_softmax, top_logprobs
from colibri_aio.text.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class GenerationPiece:
    """One step of a generation stream: new text, the token that made it, and timing so far.

    ``cached_tokens``: leading prompt tokens the KV cache already held (not
    prefilled again). ``logprob``/``top_logprobs``: with ``logprobs=n``, the
    token's log-probability and the n most likely (id, log-probability) pairs.
    """

    text: str
    token: int | None
    finish_reason: FinishReason | None
    prompt_tokens: int
    generated_tokens: int
    prefill_seconds: float
    decode_seconds: float
    stats: EngineStats
    cached_tokens: int = 0
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    stop: str | None = None   # the stop string that ended the stream (finish_reason "stop" by a string)

    @property
    def prefill_tps(self) -> float:
        """Prompt tokens prefilled (the cached ones excluded) per second."""
        n = self.prompt_tokens - self.cached_tokens
        return n / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        return self.generated_tokens / self.decode_seconds if self.decode_seconds else 0.0


class Decoding:
    """A stream after its prompt: each :meth:`piece` picks a token from the logits that follow the stream so
    far and says what it shows and whether the stream ends.

    ``ids``: the prompt; ``cached``: its leading tokens the KV cache held;
    ``prefill_s``: what its prefill took; ``tally``: called once per
    token, counts it in the engine's counters and returns them (each piece
    carries them). ``special``: the text shows special tokens (a tool-call or
    channel marker a reply parser reads); an end-of-generation token never shows.
    """

    def __init__(self, tokenizer: Tokenizer, ids: Sequence[int], max_tokens: int, stop: Sequence[str],
                 pick: TokenPicker, logprobs: int | None, cached: int, prefill_s: float,
                 tally: Callable[[], EngineStats], *, special: bool = False) -> None:
        self.stopper = Stopper(tokenizer.stream_decoder(skip_special=not special), tokenizer.is_eog,
                               max_tokens=max_tokens, stop=stop)
        self.n_prompt, self.pick, self.logprobs, self.cached = len(ids), pick, logprobs, cached
        self.prefill_s, self._tally = prefill_s, tally
        self.t_decode = time.perf_counter()   # the first token's pick starts the decode clock

    def piece(self, logits: np.ndarray) -> GenerationPiece:
        """The next token from ``logits`` (V,) and its piece; its ``finish_reason`` set when the stream ends."""
        token = self.pick(logits)
        lp, alternatives = None, ()
        if self.logprobs is not None:
            dist = log_softmax(logits)
            lp, alternatives = float(dist[token]), tuple(top_logprobs(dist, self.logprobs))
        step = self.stopper.step(token)
        stats = self._tally()
        return GenerationPiece(step.text, token, step.finish_reason, self.n_prompt, self.stopper.n_tokens,
                               self.prefill_s, time.perf_counter() - self.t_decode, stats, self.cached,
                               lp, alternatives, step.stop)
