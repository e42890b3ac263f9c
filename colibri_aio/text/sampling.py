"""Choosing the next token, and deciding when generation ends.

Sampling is a chain of small pure functions, in llama.cpp's default order:
logit bias and repetition penalties on the full logits, then over a candidate
set ``(ids, logits)`` top-k, top-p, min-p, temperature, and one draw from a
seeded NumPy ``Generator``. Temperature 0 is greedy (argmax of the biased and
penalised logits) and consumes no randomness. :class:`SamplingParams` holds
every option; :class:`TokenPicker` applies them to one generation.

Ending is :class:`StopStrings` (stop strings found in the detokenized stream,
even when split across tokens) composed with end-of-generation tokens and a
token budget in :class:`Stopper`.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, Protocol

import numpy as np

from colibri_aio.errors import UserError

__all__ = [
    "Sampler", "make_sampler", "greedy", "keep_top_k", "keep_top_p", "keep_min_p", "draw", "softmax",
    "apply_logit_bias", "apply_penalties", "log_softmax", "top_logprobs", "SamplingParams", "TokenPicker",
    "LLAMA_CPP_DEFAULTS", "model_defaults", "StopStrings", "Stopper", "Step", "FinishReason",
    "check_generation_options",
]

Sampler = Callable[[np.ndarray], int]
# A candidate set: token ids (int64, (n,)) and their logits (float64, (n,)).
Candidates = tuple[np.ndarray, np.ndarray]


def softmax(logits: np.ndarray) -> np.ndarray:
    """Probabilities of ``logits`` (float64, shifted by the max for stability)."""
    e = np.exp(logits - logits.max())
    return e / e.sum()


def greedy(logits: np.ndarray) -> int:
    """Index of the largest logit (the first one on ties)."""
    return int(np.argmax(logits))


def keep_top_k(cands: Candidates, k: int) -> Candidates:
    """Keep the ``k`` highest logits; ``k <= 0`` keeps everything."""
    ids, logits = cands
    if k <= 0 or k >= len(ids):
        return cands
    keep = np.argpartition(-logits, k - 1)[:k]
    return ids[keep], logits[keep]


def keep_top_p(cands: Candidates, p: float) -> Candidates:
    """Keep the most likely tokens until their probability mass reaches ``p`` (nucleus).

    The token that crosses ``p`` is kept, so at least one token always survives.
    """
    ids, logits = cands
    if p >= 1.0 or len(ids) <= 1:
        return cands
    probs = softmax(logits)
    # Sorting a 150k vocabulary costs ~50 ms; the nucleus is usually a few hundred
    # tokens, so sort only a top-m slice that already holds mass >= p.
    head = _top_slice_with_mass(logits, probs, p)
    order = head[np.argsort(-logits[head], kind="stable")]
    mass = np.cumsum(probs[order])
    n = min(int(np.searchsorted(mass, p, side="left")) + 1, len(order))
    keep = order[:n]
    return ids[keep], logits[keep]


def _top_slice_with_mass(logits: np.ndarray, probs: np.ndarray, p: float, start: int = 256) -> np.ndarray:
    """Indices of the m largest logits, m grown by 4x until their probability mass reaches ``p``."""
    m = start
    while m < len(logits):
        head = np.argpartition(-logits, m - 1)[:m]
        if probs[head].sum() >= p:
            return head
        m *= 4
    return np.arange(len(logits))


def keep_min_p(cands: Candidates, p: float) -> Candidates:
    """Keep tokens whose probability is at least ``p`` times the top token's."""
    ids, logits = cands
    if p <= 0.0:
        return cands
    # prob_i >= p * prob_max  <=>  logit_i - logit_max >= log p (no softmax needed)
    keep = logits >= logits.max() + np.log(p)
    return ids[keep], logits[keep]


def draw(cands: Candidates, rng: np.random.Generator) -> int:
    """One token from the softmax of the candidates' logits (one uniform from ``rng``)."""
    ids, logits = cands
    mass = np.cumsum(softmax(logits))
    i = int(np.searchsorted(mass, rng.random() * mass[-1], side="right"))
    return int(ids[min(i, len(ids) - 1)])


def apply_logit_bias(logits: np.ndarray, bias: Mapping[int, float]) -> np.ndarray:
    """``logits`` with ``bias[id]`` added to each biased token's logit (a copy; the input is kept)."""
    if not bias:
        return logits
    out = logits.copy()
    ids = np.fromiter(bias.keys(), np.int64, len(bias))
    out[ids] += np.fromiter(bias.values(), np.float64, len(bias)).astype(out.dtype)
    return out


def apply_penalties(logits: np.ndarray, recent: Sequence[int], *, repeat: float = 1.0, frequency: float = 0.0,
                    presence: float = 0.0) -> np.ndarray:
    """llama.cpp's repetition penalties over the ``recent`` token ids (a copy; the input is kept).

    Each token that occurs c > 0 times has its logit divided by ``repeat``
    (multiplied when the logit is <= 0), then lowered by
    ``c * frequency + presence`` (OpenAI's frequency and presence penalties).
    """
    if len(recent) == 0 or (repeat == 1.0 and frequency == 0.0 and presence == 0.0):
        return logits
    ids, counts = np.unique(np.asarray(recent, dtype=np.int64), return_counts=True)
    out = logits.copy()
    seen = out[ids]
    seen = np.where(seen <= 0, seen * repeat, seen / repeat) - counts * frequency - presence
    out[ids] = seen
    return out


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities of ``logits`` (float64)."""
    x = logits.astype(np.float64) - logits.max()
    return x - np.log(np.exp(x).sum())


def top_logprobs(logprobs: np.ndarray, n: int) -> list[tuple[int, float]]:
    """The ``n`` most likely (token id, log-probability) pairs, most likely first (lower id on ties)."""
    if n <= 0:
        return []
    n = min(n, len(logprobs))
    head = np.argpartition(-logprobs, n - 1)[:n]
    head = head[np.lexsort((head, -logprobs[head]))]
    return [(int(i), float(logprobs[i])) for i in head]


def check_sampling_options(temperature: float, top_k: int, top_p: float, min_p: float,
                           seed: int | None = None) -> None:
    """Refuse values that have no meaning, with one line naming the option."""
    if not np.isfinite(temperature) or temperature < 0:
        raise UserError(f"temperature must be >= 0, got {temperature}")
    if top_k < 0:
        raise UserError(f"top-k must be >= 0 (0 = off), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise UserError(f"top-p must be in (0, 1] (1 = off), got {top_p}")
    if not 0.0 <= min_p <= 1.0:
        raise UserError(f"min-p must be in [0, 1] (0 = off), got {min_p}")
    if seed is not None and seed < 0:
        raise UserError(f"seed must be >= 0, got {seed}")


def make_sampler(temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                 seed: int | None = None) -> Sampler:
    """A function from float logits of shape (vocab,) to the next token id.

    Temperature 0 is greedy. Otherwise the candidates are filtered by top-k,
    top-p and min-p (each off at its default), scaled by ``1/temperature`` and
    drawn from a ``Generator`` seeded with ``seed``: the same seed and the same
    logits give the same tokens.
    """
    check_sampling_options(temperature, top_k, top_p, min_p, seed)
    if temperature == 0.0:
        return greedy
    rng = np.random.default_rng(seed)

    def sample(logits: np.ndarray) -> int:
        if logits.ndim != 1:
            raise ValueError(f"a sampler takes the logits of one position, shape (vocab,); got {logits.shape}")
        cands: Candidates = (np.arange(logits.shape[-1]), logits.astype(np.float64))
        ids, kept = keep_min_p(keep_top_p(keep_top_k(cands, top_k), top_p), min_p)
        return draw((ids, kept / temperature), rng)

    return sample


@dataclass(frozen=True)
class SamplingParams:
    """Every option that chooses a token. The defaults are greedy with no penalties."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repeat_penalty: float = 1.0      # llama.cpp: divide a recent token's logit by this (1 = off)
    presence_penalty: float = 0.0    # OpenAI: subtract from every recent token's logit
    frequency_penalty: float = 0.0   # OpenAI: subtract times the token's recent count
    penalty_last_n: int = 64         # how many recent tokens the penalties see (0 = none, -1 = all)
    logit_bias: Mapping[int, float] = field(default_factory=dict)

    def check(self, vocab_size: int | None = None) -> None:
        """Refuse values that have no meaning, with one line naming the option."""
        check_sampling_options(self.temperature, self.top_k, self.top_p, self.min_p, self.seed)
        if not (np.isfinite(self.repeat_penalty) and self.repeat_penalty > 0):
            raise UserError(f"repeat-penalty must be > 0 (1 = off), got {self.repeat_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not np.isfinite(getattr(self, name)):
                raise UserError(f"{name.replace('_', '-')} must be a finite number, got {getattr(self, name)}")
        if self.penalty_last_n < -1:
            raise UserError(f"penalty-last-n must be >= -1 (-1 = the whole context), got {self.penalty_last_n}")
        for token, bias in self.logit_bias.items():
            if vocab_size is not None and not 0 <= token < vocab_size:
                raise UserError(f"logit-bias: token id {token} is not in [0, {vocab_size})")
            if not np.isfinite(bias):
                raise UserError(f"logit-bias: the bias of token {token} must be finite, got {bias}")

    def override(self, options: Mapping[str, Any]) -> "SamplingParams":
        """These parameters with each option that is given (not None) put in."""
        return replace(self, **{k: v for k, v in options.items() if v is not None})

    @property
    def penalised(self) -> bool:
        return self.penalty_last_n != 0 and (self.repeat_penalty != 1.0 or self.presence_penalty != 0.0
                                             or self.frequency_penalty != 0.0)


def check_generation_options(*, max_tokens: int | None, sampling: SamplingParams,
                             vocab_size: int | None = None) -> None:
    """Every option of a generation, refused before any work starts (one line naming the option).

    ``max_tokens`` None: to the end of the context.
    """
    if max_tokens is not None and max_tokens < 1:
        raise UserError(f"max-tokens must be >= 1, got {max_tokens}")
    sampling.check(vocab_size)


# llama.cpp's defaults (common/common.h), for a model whose GGUF names none.
LLAMA_CPP_DEFAULTS = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0,
                                    penalty_last_n=64)

# general.sampling.* keys (gguf-py Keys.General.SAMPLING_*) and the option each sets.
GGUF_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repeat_penalty", "general.sampling.penalty_last_n": "penalty_last_n",
}


def model_defaults(metadata: Mapping[str, Any]) -> SamplingParams:
    """Sampling defaults of a model: its ``general.sampling.*`` keys where present, else llama.cpp's."""
    types = {f.name: f.type for f in fields(SamplingParams)}
    found = {opt: (int if types[opt] == "int" else float)(metadata[key])
             for key, opt in GGUF_SAMPLING_KEYS.items() if metadata.get(key) is not None}
    return replace(LLAMA_CPP_DEFAULTS, **found)


class TokenConstraint(Protocol):
    """What a generation may say next (a grammar, a forced span): it sees every token chosen."""

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """``logits`` (V,) with every token not allowed next at -inf (a copy, or ``logits`` itself)."""
        ...

    def accept(self, token_id: int) -> None:
        """The token chosen (one the last :meth:`mask` allowed)."""
        ...


class TokenPicker:
    """Chooses the next token of one generation: logit bias, penalties over the recent context, an optional
    :class:`TokenConstraint`, sampler chain.

    ``context``: the prompt ids; each picked token joins the window the
    penalties see (the last ``penalty_last_n`` tokens, as llama.cpp counts them).
    The constraint masks after bias and penalties, so no adjustment can bring
    back a token it forbids.
    """

    def __init__(self, params: SamplingParams, context: Sequence[int] = (),
                 constraint: TokenConstraint | None = None) -> None:
        params.check()
        self.params = params
        self.constraint = constraint
        self._sample = make_sampler(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                    min_p=params.min_p, seed=params.seed)
        n = params.penalty_last_n
        self._recent: deque[int] | None = None
        if params.penalised:
            self._recent = deque(context, maxlen=None if n < 0 else n)  # a bounded deque keeps the last n

    def __call__(self, logits: np.ndarray) -> int:
        p = self.params
        adjusted = apply_logit_bias(logits, p.logit_bias)
        if self._recent is not None:
            adjusted = apply_penalties(adjusted, self._recent, repeat=p.repeat_penalty,
                                       frequency=p.frequency_penalty, presence=p.presence_penalty)
        if self.constraint is not None:
            adjusted = self.constraint.mask(adjusted)
        token = self._sample(adjusted)
        if self.constraint is not None:
            self.constraint.accept(token)
        if self._recent is not None:
            self._recent.append(token)
        return token


FinishReason = Literal["stop", "length"]


class StopStrings:
    """Finds stop strings in text that arrives in pieces.

    :meth:`feed` returns the text that is safe to show: anything that could be
    the start of a stop string is held back until the next piece decides. When
    a stop string completes, the text before it is returned and nothing after
    it ever is. Generation stops at the first stop string to *complete*, so the
    result does not depend on how the text was cut into pieces.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._buf = ""
        self.stopped: str | None = None  # the stop string that ended the text

    def feed(self, text: str) -> tuple[str, bool]:
        """Add ``text``; return (text safe to emit, whether a stop string completed)."""
        if self.stopped is not None:
            return "", True
        buf = self._buf + text
        hit = first_completed(buf, self.stops)
        if hit is not None:
            start, stop = hit
            self._buf, self.stopped = "", stop
            return buf[:start], True
        held = longest_partial_suffix(buf, self.stops)
        self._buf = buf[len(buf) - held:] if held else ""
        return buf[:len(buf) - held], False

    def flush(self) -> str:
        """The text is over: release what was held back (it cannot become a stop any more)."""
        out, self._buf = self._buf, ""
        return out


def first_completed(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """(start, stop) of the stop string that ends earliest in ``text``; the longest on a tie."""
    best: tuple[int, int, str] | None = None
    for s in stops:
        i = text.find(s)
        if i >= 0:
            key = (i + len(s), i, s)  # earliest end, then earliest start
            if best is None or key < best:
                best = key
    return None if best is None else (best[1], best[2])


def longest_partial_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of some stop string."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


class TokenDecoder(Protocol):
    """What :class:`Stopper` needs of a streaming detokenizer."""

    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


@dataclass(frozen=True)
class Step:
    """What one generated token produced: text to show, and why generation ended (None: go on); ``stop``: the
    stop string that ended it."""

    text: str
    finish_reason: FinishReason | None
    stop: str | None = None


class Stopper:
    """Turns generated ids into shown text and ends generation.

    Ends with "stop" on an end-of-generation token (its text is not shown) or
    a stop string (its text and what follows are not shown), and with
    "length" after ``max_tokens`` tokens (``None``: no limit).
    """

    def __init__(self, decoder: TokenDecoder, is_eog: Callable[[int], bool], *,
                 max_tokens: int | None = None, stop: Sequence[str] = ()) -> None:
        if max_tokens is not None and max_tokens < 1:
            raise UserError(f"max-tokens must be >= 1, got {max_tokens}")
        self._decoder = decoder
        self._is_eog = is_eog
        self.max_tokens = max_tokens
        self._stops = StopStrings(stop)
        self.n_tokens = 0
        self.finish_reason: FinishReason | None = None

    def step(self, token_id: int) -> Step:
        """Account for one generated token."""
        if self.finish_reason is not None:
            raise RuntimeError("generation has already finished")
        self.n_tokens += 1
        if self._is_eog(token_id):
            return self._end(self._decoder.flush(), "stop")
        text, hit = self._stops.feed(self._decoder.push(token_id))
        if hit:
            return self._finish(text, "stop")
        if self.max_tokens is not None and self.n_tokens >= self.max_tokens:
            return self._end(self._decoder.flush(), "length", before=text)
        return Step(text, None)

    def _end(self, tail: str, reason: FinishReason, before: str = "") -> Step:
        """No more tokens will come: the decoder's tail and held-back text go out, unless they stop."""
        text, hit = self._stops.feed(tail)
        if hit:
            return self._finish(before + text, "stop")
        return self._finish(before + text + self._stops.flush(), reason)

    def _finish(self, text: str, reason: FinishReason) -> Step:
        self.finish_reason = reason
        return Step(text, reason, self._stops.stopped)
