"""A token constraint for models that think before they answer: a thinking budget, then the answer's grammar.

A reply of a thinking model has two parts: the thinking span (``<think>…</think>``,
gpt-oss's analysis channel) and the answer. A grammar (a JSON schema, a forced
tool call) applies to the answer only; a thinking budget caps the span. The
gate follows the generated text token by token::

    before ──(the open marker is written)──► thinking ──(the close marker appears)──────────► answer
       └──(the reply starts otherwise)──────────┼──────────────────────────────────────────────┘ (grammar, if any)
                                                └──(budget spent)──► forcing the close ids ──┘

A reply starts ``before`` when the prompt did not open the span itself
(Qwen3's template leaves ``<think>`` to the model); it only watches there: a
grammar that must hold from the first token is the caller's to apply without
a gate.

While thinking, any token is allowed except end-of-generation (a reply that
stops mid-thought has no answer); once the budget is spent, only the next id of
the close marker is, until it is written. After it, the ``answer`` constraint
masks every pick (None: any token).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from colibri_aio.text.sampling import TokenConstraint


class ReasoningGate:
    """:class:`~colibri_aio.text.sampling.TokenConstraint` of a reply that starts inside its thinking span.

    ``close``: the close marker's text (``"</think>"``) and ``close_ids`` its token
    ids (what the gate forces); ``token_text``: a token's text as generated,
    special markers included; ``budget``: thinking tokens before the span is
    closed (None: no limit); ``eog``: end-of-generation ids, refused while thinking.
    """

    def __init__(self, *, close: str, close_ids: Sequence[int], token_text: Callable[[int], str],
                 budget: int | None, eog: Sequence[int], answer: TokenConstraint | None = None,
                 open_marker: str | None = None) -> None:
        if not close or not close_ids:
            raise ValueError("the close marker must not be empty")
        self.close, self.close_ids = close, list(close_ids)
        self.token_text, self.budget, self.answer = token_text, budget, answer
        self.eog = np.asarray(sorted(set(eog)), dtype=np.int64)
        self.open_marker = open_marker   # None: the reply starts inside the span
        self._head = ""                  # the reply's text before the span opened
        self.thinking = open_marker is None
        self.spent = 0          # thinking tokens so far
        self._forced = 0        # close-marker ids written while forcing
        self._tail = ""         # the end of the thinking text, long enough to hold the close marker

    @property
    def forcing(self) -> bool:
        return self.thinking and self.budget is not None and self.spent >= self.budget

    @property
    def before(self) -> bool:
        return self.open_marker is not None

    def mask(self, logits: np.ndarray) -> np.ndarray:
        if self.before:
            return logits
        if not self.thinking:
            return logits if self.answer is None else self.answer.mask(logits)
        if self.forcing:
            out = np.full_like(logits, -np.inf)
            token = self.close_ids[self._forced]
            out[token] = logits[token]
            return out
        if self.eog.size == 0:
            return logits
        out = logits.copy()
        out[self.eog] = -np.inf
        return out

    def accept(self, token_id: int) -> None:
        if self.before:
            self._watch_opening(self.token_text(token_id))
            return
        if not self.thinking:
            if self.answer is not None:
                self.answer.accept(token_id)
            return
        if self.forcing:
            self._forced += 1
            if self._forced == len(self.close_ids):
                self._end_thinking()
            return
        self.spent += 1
        self._tail = (self._tail + self.token_text(token_id))[-4 * len(self.close):]
        if self.close in self._tail:
            self._end_thinking()

    def _watch_opening(self, text: str) -> None:
        """Before the span: open it when the marker is written, else leave for the answer once the reply's start
        (past leading whitespace) can no longer be the marker."""
        assert self.open_marker is not None
        self._head += text
        start = self._head.lstrip()
        if start.startswith(self.open_marker):
            self._tail = start[len(self.open_marker):]
            self.open_marker = None
            self.thinking = True
        elif start and not self.open_marker.startswith(start):
            self.open_marker = None
            self.thinking = False

    def _end_thinking(self) -> None:
        self.thinking = False
        self._tail = ""
