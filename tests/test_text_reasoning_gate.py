"""The thinking gate: a budget that closes the thinking span, a grammar only after it, end-of-generation held off
while thinking."""
from __future__ import annotations

import numpy as np
import pytest

from colibri_aio.text.reasoning_gate import ReasoningGate

# A toy vocabulary: ids 0..9 are single letters, 10 "<think>", 11 "</think>", 12 "</", 13 "think>", 14 end,
# 15 a newline, 16 "<th", 17 "ink>".
TEXT = {**{i: "abcdefghij"[i] for i in range(10)}, 10: "<think>", 11: "</think>", 12: "</", 13: "think>", 14: "",
        15: "\n", 16: "<th", 17: "ink>"}
V, EOG = len(TEXT), 14


class OnlyA:
    """An answer grammar that allows only token 0 and counts what it was shown."""

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def mask(self, logits: np.ndarray) -> np.ndarray:
        out = np.full_like(logits, -np.inf)
        out[0] = logits[0]
        return out

    def accept(self, token_id: int) -> None:
        self.accepted.append(token_id)


def gate(budget: int | None, answer: OnlyA | None = None, *, open_marker: str | None = None) -> ReasoningGate:
    return ReasoningGate(close="</think>", close_ids=[12, 13], token_text=TEXT.__getitem__, budget=budget,
                         eog=[EOG], answer=answer, open_marker=open_marker)


def allowed(g: ReasoningGate) -> set[int]:
    return set(np.flatnonzero(np.isfinite(g.mask(np.zeros(V, dtype=np.float32)))).tolist())


def test_the_budget_forces_the_close_marker_then_the_answer_grammar_holds():
    answer = OnlyA()
    g = gate(3, answer)
    for token in (1, 2, 3):
        assert EOG not in allowed(g)      # no reply ends mid-thought
        g.accept(token)
    assert allowed(g) == {12}              # the budget is spent: the close marker, id by id
    g.accept(12)
    assert allowed(g) == {13}
    g.accept(13)
    assert not g.thinking and allowed(g) == {0}
    g.accept(0)
    assert answer.accepted == [0]          # the grammar sees the answer's tokens only


def test_a_span_the_model_closes_itself_ends_the_gate_even_split_over_tokens():
    g = gate(100, OnlyA())
    for token in (1, 12, 13):              # "b" "</" "think>"
        g.accept(token)
    assert not g.thinking and allowed(g) == {0}
    assert g.spent == 3


def test_without_budget_nothing_is_forced_while_thinking():
    g = gate(None)
    for _ in range(50):
        assert allowed(g) == set(range(V)) - {EOG}
        g.accept(4)
    g.accept(11)
    assert allowed(g) == set(range(V))


def test_a_zero_budget_closes_the_span_at_once():
    g = gate(0)
    assert allowed(g) == {12}


@pytest.mark.parametrize("first, thinking", [([10], True), ([15, 16, 17], True), ([5], False), ([16, 5], False)])
def test_before_the_span_the_gate_only_watches(first, thinking):
    g = gate(2, open_marker="<think>")
    assert allowed(g) == set(range(V))   # the model decides whether to think
    for token in first:
        g.accept(token)
    assert not g.before and g.thinking is thinking
    if thinking:
        g.accept(1)
        g.accept(2)
        assert allowed(g) == {12}         # the budget counts from the span's start


def test_an_empty_close_marker_is_refused():
    with pytest.raises(ValueError, match="close marker"):
        ReasoningGate(close="", close_ids=[], token_text=TEXT.__getitem__, budget=1, eog=[EOG])
