"""The KV cache: keys and values of every layer for up to ``n_ctx`` positions, allocated once.

Stored in float16 by default, as llama.cpp does: half the memory of float32
(a Qwen3-30B-A3B file at 4096 positions: 0.375 GiB instead of 0.75 GiB) for a
rounding of each key and value to 11 significant bits. Attention reads them
back as float32. The rounding is a pure function of the value, so placement
still never changes a bit; against a float32 oracle the logits move by about
1e-3 of their range (the tolerance tests/test_arch_qwen3moe.py states).

A sliding-window layer (gpt-oss) keeps only its window of positions, in a
ring. A recurrent layer (qwen3next's gated DeltaNet) keeps no keys at all but
a fixed state of the sequence so far (:class:`RecurrentShape`), in float32 as
llama.cpp keeps it, twice: the state the step reads and the one it writes,
which becomes the state only once the whole step has run (a step that is
discarded, or fails, leaves it as it was). ``plan``, the start line and the
allocation take their size from :func:`kv_nbytes`, so what is printed is what
is allocated.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from colibri_aio.errors import UserError

if TYPE_CHECKING:
    from colibri_aio.arch.base import KVLayout

KV_TYPES: dict[str, type[np.floating]] = {"f16": np.float16, "f32": np.float32}
DEFAULT_KV_TYPE = "f16"
# KV-cache positions when none are asked for, as llama.cpp's llama-cli: a
# Qwen3-30B-A3B file says 40960, which would reserve 3.75 GiB of f16 KV (7.5 GiB
# in f32) out of the budget the experts need.
DEFAULT_CONTEXT = 4096


@dataclass(frozen=True, slots=True)
class RecurrentShape:
    """The state a recurrent block keeps of a sequence in place of keys and values: the last
    ``conv_width`` inputs of its causal convolution over ``conv_channels`` channels, and a
    (``head_width``, ``head_width``) map per head for ``heads`` heads."""

    conv_channels: int
    conv_width: int
    heads: int
    head_width: int

    @property
    def floats(self) -> int:
        return self.conv_channels * self.conv_width + self.heads * self.head_width * self.head_width


# Copies of the recurrent states kept at the end of recent prompts, so that a later prompt sharing that
# prefix (a chat's next turn, a regenerated answer) continues from there instead of from position 0: a
# recurrent state cannot be wound back. llama-server keeps such context checkpoints too (--ctx-checkpoints).
# Two cover a chat's next turn and a retry of the last one; each costs one state (~76 MB for
# Qwen3-Next-80B's 36 DeltaNet blocks), which the plan counts.
STATE_CHECKPOINTS = 2


def check_kv_type(kv_type: str) -> str:
    """``kv_type`` if it names a KV storage type, else a :class:`UserError` listing them."""
    if kv_type not in KV_TYPES:
        raise UserError(f"unknown --kv-type {kv_type!r} (choose from {', '.join(KV_TYPES)})")
    return kv_type


def default_context(model_context: int) -> int:
    """Positions to allocate when none are asked for: the model's, at most :data:`DEFAULT_CONTEXT`."""
    return min(model_context, DEFAULT_CONTEXT)


def held_positions(n_ctx: int, window: int | None) -> int:
    """Positions a layer's cache holds: the whole context, or its sliding window (a ring) when shorter."""
    return n_ctx if window is None else min(n_ctx, window)


def kv_nbytes(n_layer: int, n_ctx: int, layout: KVLayout, kv_type: str = DEFAULT_KV_TYPE,
              windows: Sequence[int | None] | None = None,
              recurrent: Sequence[RecurrentShape | None] | None = None) -> int:
    """Bytes of the cache :class:`KVCache` allocates for ``layout`` stored as ``kv_type``, with each layer's
    sliding window (None: every layer sees the whole context) and each recurrent layer's state (no keys;
    its state twice, in float32, and once more per checkpoint)."""
    itemsize = np.dtype(KV_TYPES[check_kv_type(kv_type)]).itemsize
    windows = windows if windows is not None else [None] * n_layer
    recurrent = recurrent if recurrent is not None else [None] * n_layer
    positions = sum(held_positions(n_ctx, w) for w, r in zip(windows, recurrent) if r is None)
    states = sum((2 + STATE_CHECKPOINTS) * r.floats * 4 for r in recurrent if r is not None)
    return positions * layout.floats_per_position * itemsize + states


class KVCache:
    """Keys (Hkv, key_width) and values (Hkv, value_width) of every layer, allocated once; with
    ``layout.values_in_keys`` each value is a view of its key's first numbers (MLA's latent).

    A layer with a sliding window of w positions (``windows``) keeps only the last min(n_ctx, w)
    positions, in a ring (position p in slot p mod w): its queries never see an older key. A chunked
    layer (``chunked``: llama4) has the same ring; its queries see less of it (their chunk's keys). Other
    layers keep ``n_ctx`` positions. ``held[layer]`` is the range of positions a layer's arrays
    hold, so the net can tell which prefixes it can continue from after a rewind.
    """

    def __init__(self, n_layer: int, n_ctx: int, layout: KVLayout, kv_type: str = DEFAULT_KV_TYPE,
                 windows: Sequence[int | None] | None = None, chunked: Sequence[bool] | None = None,
                 recurrent: Sequence[RecurrentShape | None] | None = None) -> None:
        self.dtype = KV_TYPES[check_kv_type(kv_type)]
        self.n_ctx, self.layout, self.kv_type = n_ctx, layout, kv_type
        self.windows = tuple(windows) if windows is not None else (None,) * n_layer
        # per layer: its window is a chunk (a query sees its chunk's keys only; the ring is the same)
        self.chunked = tuple(chunked) if chunked is not None else (False,) * n_layer
        # per layer: the state a recurrent layer keeps instead of keys (None: an attention layer)
        self.recurrent = tuple(recurrent) if recurrent is not None else (None,) * n_layer
        self.conv: list[np.ndarray | None] = []       # (C, K-1) the state a step reads ...
        self.ssm: list[np.ndarray | None] = []        # (H, w, w)
        self.conv_next: list[np.ndarray | None] = []  # ... and the one it writes
        self.ssm_next: list[np.ndarray | None] = []
        for r in self.recurrent:
            made = [None] * 4 if r is None else [np.zeros(shape, np.float32) for shape in (
                (r.conv_channels, r.conv_width), (r.heads, r.head_width, r.head_width)) * 2]
            for store, array in zip((self.conv, self.ssm, self.conv_next, self.ssm_next), made):
                store.append(array)
        # checkpoints: per slot, each layer's (conv, ssm) copy, and the positions it holds (-1: empty)
        any_recurrent = any(r is not None for r in self.recurrent)
        self._saved = [[None if c is None else (np.zeros_like(c), np.zeros_like(m))
                        for c, m in zip(self.conv, self.ssm)] for _ in range(STATE_CHECKPOINTS * any_recurrent)]
        self._saved_at = [-1] * len(self._saved)
        self._saved_order: list[int] = []   # slots, oldest first
        self.k: list[np.ndarray] = []
        self.v: list[np.ndarray] = []
        for window, r in zip(self.windows, self.recurrent):
            held = 0 if r is not None else held_positions(n_ctx, window)
            k = np.zeros((held, layout.heads, layout.key_width), self.dtype)
            self.k.append(k)
            self.v.append(k[..., :layout.value_width] if layout.values_in_keys
                          else np.zeros((len(k), layout.heads, layout.value_width), self.dtype))
        self.held = [(0, 0)] * n_layer   # per layer: positions [first, end) in its arrays

    @property
    def nbytes(self) -> int:
        states = sum(a.nbytes for store in (self.conv, self.ssm, self.conv_next, self.ssm_next)
                     for a in store if a is not None)
        states += sum(a.nbytes for slot in self._saved for pair in slot if pair is not None for a in pair)
        return states + sum(k.nbytes + (0 if self.layout.values_in_keys else v.nbytes)
                            for k, v in zip(self.k, self.v))

    def is_ring(self, layer: int) -> bool:
        return self.recurrent[layer] is None and len(self.k[layer]) < self.n_ctx

    # --- recurrent layers -----------------------------------------------------------------------

    def start(self, first: int) -> None:
        """A step begins at position ``first``: a recurrent layer's state is the sequence's before it, or
        zeros at the start of a sequence."""
        for layer, r in enumerate(self.recurrent):
            if r is None:
                continue
            if first == 0:
                self.conv[layer][:] = 0   # type: ignore[index]
                self.ssm[layer][:] = 0    # type: ignore[index]
            elif self.held[layer][1] != first:
                raise RuntimeError(f"layer {layer}'s recurrent state holds {self.held[layer][1]} positions, "
                                   f"not the {first} this step continues")

    def checkpoint(self) -> None:
        """Keep a copy of every recurrent state as it is now (the sequence's first ``end`` positions), in
        place of the oldest copy; :meth:`forget_after` takes it back when the context is cut to ``end``."""
        ends = {end for (_, end), r in zip(self.held, self.recurrent) if r is not None}
        if not self._saved or len(ends) != 1:
            return
        end = ends.pop()
        if end <= 0 or end in self._saved_at:
            return
        slot = self._saved_at.index(-1) if -1 in self._saved_at else self._saved_order.pop(0)
        for pair, conv, ssm in zip(self._saved[slot], self.conv, self.ssm):
            if pair is not None:
                np.copyto(pair[0], conv)  # type: ignore[arg-type]
                np.copyto(pair[1], ssm)   # type: ignore[arg-type]
        self._saved_at[slot] = end
        self._saved_order.append(slot)

    def drop_checkpoints(self) -> None:
        """Forget every kept copy of the recurrent states (the context they were taken from is gone)."""
        self._saved_at = [-1] * len(self._saved)
        self._saved_order = []

    @property
    def checkpoints(self) -> list[int]:
        """The context lengths whose recurrent states are kept, ascending."""
        return sorted(end for end in self._saved_at if end >= 0)

    def commit(self, end: int) -> None:
        """The step ending before position ``end`` ran whole: the states it wrote become the sequence's."""
        for layer, r in enumerate(self.recurrent):
            if r is not None:
                np.copyto(self.conv[layer], self.conv_next[layer])  # type: ignore[arg-type]
                np.copyto(self.ssm[layer], self.ssm_next[layer])    # type: ignore[arg-type]
                self.held[layer] = (0, end)

    def update(self, layer: int, positions: np.ndarray, k: np.ndarray,
               v: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Keep keys (T, Hkv, key_width) and values (T, Hkv, value_width; None when they live in the keys)
        at ``positions`` (consecutive, from the context's end), rounded to the storage type, and return
        what the queries at those positions attend over, as float32: keys, values and their positions
        (None: 0..positions[-1]).

        A ring's keys for the chunk are gathered before the chunk's own writes reuse their slots.
        """
        keys, values = self.k[layer], self.v[layer]
        first, end = int(positions[0]), int(positions[-1]) + 1
        held_first = self.held[layer][0]
        if not self.is_ring(layer):
            self._write(layer, positions, k, v)
            self.held[layer] = (held_first, end)
            return keys[:end].astype(np.float32, copy=False), values[:end].astype(np.float32, copy=False), None
        window, size = self.windows[layer], len(keys)
        older = np.arange(max(0, first - window + 1), first)              # earlier positions the chunk sees
        slots = older % size
        new_k = k.astype(self.dtype, copy=False)                            # as the cache stores them
        new_v = new_k[..., :self.layout.value_width] if v is None else v.astype(self.dtype, copy=False)
        out_k = np.concatenate([keys[slots], new_k]).astype(np.float32, copy=False)
        out_v = np.concatenate([values[slots], new_v]).astype(np.float32, copy=False)
        keep = slice(max(0, len(positions) - size), None)                 # the chunk's last `size` positions
        self._write(layer, positions[keep] % size, new_k[keep], None if v is None else new_v[keep])
        self.held[layer] = (max(held_first, end - size), end)
        return out_k, out_v, np.concatenate([older, positions])

    def wrote(self, layer: int, end: int) -> None:
        """Position ``end`` - 1, the context's next, was written in place by a kernel graph (into slot
        ``end - 1`` mod the ring's size on a ring); a recurrent layer's state waits for :meth:`commit`."""
        if self.recurrent[layer] is not None:
            return
        first = self.held[layer][0]
        self.held[layer] = (max(first, end - len(self.k[layer])) if self.is_ring(layer) else first, end)

    def _write(self, layer: int, slots: np.ndarray, k: np.ndarray, v: np.ndarray | None) -> None:
        self.k[layer][slots] = k
        if not self.layout.values_in_keys:
            self.v[layer][slots] = v

    def can_continue(self, n_past: int) -> bool:
        """Whether the next position n_past finds every key it attends to: positions max(0, n_past - w + 1)
        .. n_past - 1 of each layer (w its window, or the whole context) are in its arrays; a recurrent
        layer's state must be that of exactly n_past positions (it cannot be wound back)."""
        for (first, end), window, r in zip(self.held, self.windows, self.recurrent):
            if r is not None:
                if n_past and end != n_past and n_past not in self._saved_at:
                    return False
                continue
            need = 0 if window is None else max(0, n_past - window + 1)
            if n_past and (need < first or n_past > end):
                return False
        return True

    def forget_after(self, n_past: int) -> None:
        """Positions from n_past on are no longer part of the context. A recurrent state that held more
        is no state of n_past positions: it is taken back from a checkpoint of exactly n_past positions,
        else -1 marks it lost; checkpoints of longer contexts go (their positions are no longer this
        context's)."""
        restore = self._saved_at.index(n_past) if n_past > 0 and n_past in self._saved_at else None
        held = []
        for layer, ((first, end), r) in enumerate(zip(self.held, self.recurrent)):
            if r is None or end == n_past or (end < n_past and restore is None):
                held.append((min(first, n_past), min(end, n_past)))
            elif restore is not None:
                conv, ssm = self._saved[restore][layer]  # type: ignore[misc]
                np.copyto(self.conv[layer], conv)      # type: ignore[arg-type]
                np.copyto(self.ssm[layer], ssm)        # type: ignore[arg-type]
                held.append((0, n_past))
            else:
                held.append((0, -1))
        self.held = held
        for slot, end in enumerate(self._saved_at):
            if end > n_past:
                self._saved_at[slot] = -1
                self._saved_order.remove(slot)
