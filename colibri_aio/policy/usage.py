"""Which experts a model uses, remembered across runs, and the pins chosen from it.

A usage history counts (layer, expert) selections. At the start of each run
every count is multiplied by ``decay``, so what the model did recently weighs
more than what it did long ago (a count seen ``n`` runs ago weighs
``decay**n``). ``--pin auto`` pins the hottest experts within a pin budget.

The file is JSON, versioned, and tied to the model's identity by a
fingerprint of its GGUF header — metadata, tensor table (names, types,
shapes, offsets) and file size — not its path: a model moved or copied keeps
its history, and a history never applies to a different model even at the
same path. A file of another format version or another model is refused.

Where it lives: ``$XDG_CACHE_HOME/colibri_aio/usage/<fingerprint>.json``
(``~/.cache/...`` without XDG). Not next to the model: model directories are
often read-only or shared between users, and keying by fingerprint already
finds the history wherever the model is.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from colibri_aio.errors import UserError
from colibri_aio.gguf.model import Model
from colibri_aio.policy.cache import Key

USAGE_FORMAT, USAGE_VERSION = "colibri-aio-usage", 1
DEFAULT_DECAY = 0.9


def model_fingerprint(model: Model) -> str:
    """A hex digest of the GGUF's header (metadata and tensor table) and file size (never its path)."""
    h = hashlib.sha256()
    h.update(f"size={model.identity.size}\n".encode())
    h.update(model.reader.header_bytes)
    return h.hexdigest()[:32]


def default_usage_path(fingerprint: str) -> Path:
    """Where ``--pin auto`` keeps the history of the model with ``fingerprint``."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "colibri_aio" / "usage" / f"{fingerprint}.json"


class UsageHistory:
    """Decayed selection counts per (layer, expert) of one model."""

    def __init__(self, fingerprint: str, block_count: int, expert_count: int, *,
                 decay: float = DEFAULT_DECAY, runs: int = 0, counts: np.ndarray | None = None) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.fingerprint, self.decay, self.runs = fingerprint, decay, runs
        self.counts = np.zeros((block_count, expert_count)) if counts is None else np.asarray(counts, float)
        if self.counts.shape != (block_count, expert_count):
            raise ValueError(f"counts shape {self.counts.shape} != ({block_count}, {expert_count})")

    @classmethod
    def for_model(cls, model: Model, decay: float = DEFAULT_DECAY) -> "UsageHistory":
        return cls(model_fingerprint(model), model.args.block_count, model.args.expert_count, decay=decay)

    def begin_run(self) -> None:
        """A new run starts: older counts fade by ``decay``."""
        self.counts *= self.decay
        self.runs += 1

    def record(self, layer: int, experts: Any) -> None:
        """``layer`` routed to ``experts`` at one position (repeat ids count repeatedly)."""
        np.add.at(self.counts[layer], np.asarray(experts, np.int64), 1.0)

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

    # --- file ----------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {"format": USAGE_FORMAT, "version": USAGE_VERSION, "fingerprint": self.fingerprint,
                "block_count": self.counts.shape[0], "expert_count": self.counts.shape[1],
                "decay": self.decay, "runs": self.runs, "counts": self.counts.round(6).tolist()}

    @classmethod
    def from_json(cls, doc: Any, fingerprint: str, source: str) -> "UsageHistory":
        """Parse a document; refuses another format, version or model with a :class:`UserError`."""
        if not isinstance(doc, dict) or doc.get("format") != USAGE_FORMAT:
            raise UserError(f"{source}: not a {USAGE_FORMAT} file")
        if doc.get("version") != USAGE_VERSION:
            raise UserError(f"{source}: usage history version {doc.get('version')!r} is not supported "
                            f"(this engine reads version {USAGE_VERSION}); delete it to start a new one")
        if doc.get("fingerprint") != fingerprint:
            raise UserError(f"{source}: usage history belongs to another model (fingerprint "
                            f"{doc.get('fingerprint')!r}, this model is {fingerprint!r})")
        try:
            return cls(fingerprint, int(doc["block_count"]), int(doc["expert_count"]),
                       decay=float(doc["decay"]), runs=int(doc["runs"]), counts=np.asarray(doc["counts"], float))
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"{source}: damaged usage history ({exc.__class__.__name__}: {exc})") from None

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write atomically (temporary file + rename), so a crash never leaves half a file."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name, dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(self.to_json(), f)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise

    @classmethod
    def load(cls, path: str | os.PathLike[str], fingerprint: str) -> "UsageHistory":
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise UserError(f"{path}: cannot read usage history ({exc.strerror or exc})") from None
        try:
            doc = json.loads(text)
        except json.JSONDecodeError:
            raise UserError(f"{path}: usage history is not valid JSON") from None
        return cls.from_json(doc, fingerprint, str(path))


def pins_for(spec: str, model: Model, budget: int, *, per_layer: int | None = None) -> list[Key]:
    """The keys to pin for ``--pin auto|off|FILE`` within ``budget`` slots.

    ``auto`` uses the model's default history if there is one (none yet: no
    pins); ``FILE`` must exist and belong to this model.
    """
    if spec == "off" or budget <= 0:
        return []
    fingerprint = model_fingerprint(model)
    if spec == "auto":
        path = default_usage_path(fingerprint)
        if not path.is_file():
            return []
    else:
        path = Path(spec)
    return UsageHistory.load(path, fingerprint).hottest(budget, per_layer=per_layer)
