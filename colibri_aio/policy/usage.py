"""Which experts a model uses, remembered across runs, and the pins chosen from it.

A usage history counts (layer, expert) selections. Each run's selections are
counted on their own (a history with ``runs == 0``) and folded into the stored
history when the run ends (:meth:`UsageHistory.with_run`): older counts fade
by ``decay`` per run, so what the model did recently weighs more than what it
did long ago (a count seen ``n`` runs ago weighs ``decay**n``). Folding at the
end rather than at the start is what lets concurrent runs merge: each one
folds its own counts into whatever the file holds by then. ``--pin auto``
pins the hottest experts within a pin budget.

The document is JSON, versioned, and tied to the model's identity by a
fingerprint of its GGUF header — metadata, tensor table (names, types,
shapes, offsets) and file size, every part's for a split model — not its path: a model moved or copied keeps
its history, and a history never applies to a different model even at the
same path. A document of another format version or another model, or with
counts that are not finite and non-negative, is refused.

This module has no file I/O; where the file lives and how it is read,
written, locked and set aside is :mod:`colibri_aio.engine.history`.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from colibri_aio.errors import UserError
from colibri_aio.gguf.fingerprint import model_fingerprint
from colibri_aio.gguf.model import Model
from colibri_aio.policy.cache import Key

USAGE_FORMAT, USAGE_VERSION = "colibri-aio-usage", 1
DEFAULT_DECAY = 0.9
# Positions a history must have seen (decayed like its counts) before its counts stand for the
# workload: at 8 of 128 experts per position, 512 positions are 32 selections per expert and layer.
# Fewer, and the experts it happened to see look like all there is (a plan once printed "expected
# hit 100%" for a 30B file with 3417 of 6144 experts in the pool, from a history of a few tokens).
MIN_TOKENS = 512


class UsageHistory:
    """Decayed selection counts per (layer, expert) of one model."""

    def __init__(self, fingerprint: str, block_count: int, expert_count: int, *,
                 decay: float = DEFAULT_DECAY, runs: int = 0, counts: np.ndarray | None = None,
                 tokens: float = 0.0) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if runs < 0:
            raise ValueError(f"runs must be >= 0, got {runs}")
        if not (math.isfinite(tokens) and tokens >= 0):
            raise ValueError(f"tokens must be finite and >= 0, got {tokens}")
        self.fingerprint, self.decay, self.runs = fingerprint, decay, runs
        self.tokens = float(tokens)  # positions seen, decayed like the counts
        self.counts = np.zeros((block_count, expert_count)) if counts is None else np.array(counts, float)
        if self.counts.shape != (block_count, expert_count):
            raise ValueError(f"counts shape {self.counts.shape} != ({block_count}, {expert_count})")
        if not np.isfinite(self.counts).all() or (self.counts < 0).any():
            raise ValueError("counts must be finite and >= 0")

    @classmethod
    def for_model(cls, model: Model, decay: float = DEFAULT_DECAY) -> "UsageHistory":
        return cls(model_fingerprint(model), model.args.block_count, model.args.expert_count, decay=decay)

    def empty(self) -> "UsageHistory":
        """A history of the same model with nothing counted yet (what one run records into)."""
        return UsageHistory(self.fingerprint, *self.counts.shape, decay=self.decay)

    def with_run(self, run: "UsageHistory") -> "UsageHistory":
        """This history after one more run that counted ``run.counts``: older counts fade by ``decay``."""
        if run.fingerprint != self.fingerprint or run.counts.shape != self.counts.shape:
            raise ValueError("a run's usage can only be added to the history of the same model")
        return UsageHistory(self.fingerprint, *self.counts.shape, decay=self.decay, runs=self.runs + 1,
                            counts=self.counts * self.decay + run.counts, tokens=self.tokens * self.decay + run.tokens)

    @property
    def enough(self) -> bool:
        """Whether the history has seen enough positions (:data:`MIN_TOKENS`) to stand for the workload."""
        return self.tokens >= MIN_TOKENS

    def count_tokens(self, positions: int) -> None:
        """A forward pass over ``positions`` positions ran (its layers' selections are recorded separately)."""
        self.tokens += positions

    def record(self, layer: int, experts: Any) -> None:
        """``layer`` routed to ``experts`` at one position (repeat ids count repeatedly)."""
        np.add.at(self.counts[layer], np.asarray(experts, np.int64), 1.0)

    def nonzero(self) -> dict[Key, float]:
        """Every (layer, expert) with a count above 0, and its count."""
        return {(int(l), int(e)): float(self.counts[l, e]) for l, e in zip(*np.nonzero(self.counts > 0))}

    def hottest(self, budget: int, *, per_layer: int | None = None) -> list[Key]:
        """Up to ``budget`` keys with the highest counts (never a key with count 0).

        ``per_layer`` caps how many of one layer are chosen, so that with a
        per-layer cache each layer keeps room for its unpinned entries. Ties
        go to the lower (layer, expert), so the choice is deterministic.
        """
        order = np.lexsort((np.arange(self.counts.size), -self.counts.ravel()))
        chosen: list[Key] = []
        taken = np.zeros(self.counts.shape[0], np.int64)
        for flat in order:
            if len(chosen) >= budget or self.counts.flat[flat] <= 0:
                break
            layer, expert = divmod(int(flat), self.counts.shape[1])
            if per_layer is not None and taken[layer] >= per_layer:
                continue
            taken[layer] += 1
            chosen.append((layer, expert))
        return chosen

    # --- document ---------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {"format": USAGE_FORMAT, "version": USAGE_VERSION, "fingerprint": self.fingerprint,
                "block_count": self.counts.shape[0], "expert_count": self.counts.shape[1],
                "decay": self.decay, "runs": self.runs, "tokens": round(self.tokens, 6),
                "counts": self.counts.round(6).tolist()}

    @classmethod
    def from_json(cls, doc: Any, fingerprint: str, source: str) -> "UsageHistory":
        """Parse a document; refuses another format, version or model, or bad values, with a :class:`UserError`."""
        if not isinstance(doc, dict) or doc.get("format") != USAGE_FORMAT:
            raise UserError(f"{source}: not a {USAGE_FORMAT} file")
        if doc.get("version") != USAGE_VERSION:
            raise UserError(f"{source}: usage history version {doc.get('version')!r} is not supported "
                            f"(this engine reads version {USAGE_VERSION})")
        if doc.get("fingerprint") != fingerprint:
            raise UserError(f"{source}: usage history belongs to another model (fingerprint "
                            f"{doc.get('fingerprint')!r}, this model is {fingerprint!r})")
        try:
            runs, decay = doc["runs"], float(doc["decay"])
            if not isinstance(runs, int) or isinstance(runs, bool) or not math.isfinite(decay):
                raise ValueError("runs must be an integer and decay a number")
            # "tokens" came after version 1's first files: absent, the history has not shown it has enough.
            return cls(fingerprint, int(doc["block_count"]), int(doc["expert_count"]), decay=decay, runs=runs,
                       counts=np.asarray(doc["counts"], float), tokens=float(doc.get("tokens", 0.0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"{source}: damaged usage history ({exc.__class__.__name__}: {exc})") from None
