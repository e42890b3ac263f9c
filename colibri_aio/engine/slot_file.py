"""A sequence slot's KV cache in a file: saved once, restored across restarts, so a long prompt (an agent's
preamble) is prefilled once.

The file is an uncompressed NumPy ``.npz`` (no pickled objects) holding a
``meta`` entry, UTF-8 JSON::

    {"format": "colibri-aio slot", "version": 1, "model": <fingerprint of the GGUF header>,
     "n_ctx": ..., "kv_type": "f16", "n_past": ..., "ids": [...], "held": [[first, end], ...]}

and each layer's arrays: ``k.<layer>``/``v.<layer>`` (the positions the
layer holds: [0, end) of a full layer, the whole ring of a sliding-window
one) and ``conv.<layer>``/``ssm.<layer>`` of a recurrent layer. A file of
another model, context size or KV type is refused in one line: its keys
would be another model's, or would not fit. Restoring gives back the
arrays bit for bit, so the logits that follow equal the original's.
"""
from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from colibri_aio.arch.layers import MoETransformer
from colibri_aio.errors import UserError

FORMAT, VERSION = "colibri-aio slot", 1


def save_slot(net: MoETransformer, index: int, path: str | os.PathLike[str], fingerprint: str) -> int:
    """Write slot ``index`` of ``net`` to ``path`` (atomically: a file that exists is whole); returns the
    bytes written."""
    slot = net.slots[index]
    cache = slot.cache
    meta = {"format": FORMAT, "version": VERSION, "model": fingerprint, "n_ctx": cache.n_ctx,
            "kv_type": cache.kv_type, "n_past": slot.n_past, "ids": slot.ids[:slot.n_past],
            "held": [list(h) for h in cache.held]}
    arrays: dict[str, np.ndarray] = {"meta": np.frombuffer(json.dumps(meta).encode(), np.uint8)}
    for layer, (first, end) in enumerate(cache.held):
        if cache.recurrent[layer] is not None:
            arrays[f"conv.{layer}"] = cache.conv[layer]   # type: ignore[assignment]
            arrays[f"ssm.{layer}"] = cache.ssm[layer]     # type: ignore[assignment]
            continue
        held = slice(None) if cache.is_ring(layer) else slice(0, max(end, 0))
        arrays[f"k.{layer}"] = cache.k[layer][held]
        if not cache.layout.values_in_keys:
            arrays[f"v.{layer}"] = cache.v[layer][held]
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    try:
        with open(partial, "wb") as f:
            np.savez(f, **arrays)
        os.replace(partial, path)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise UserError(f"cannot save the slot to {path}: {exc.strerror or exc}") from None
    return path.stat().st_size


def restore_slot(net: MoETransformer, index: int, path: str | os.PathLike[str], fingerprint: str) -> int:
    """Fill slot ``index`` of ``net`` from ``path``; returns the positions restored. Refuses (one line) a file
    that is not a slot file, or of another model, context size or KV type, leaving the slot as it was."""
    path = Path(path)
    try:
        loaded = np.load(path, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):     # a bare .npy array
            raise ValueError("not an archive")
        with loaded as npz:
            arrays = {name: npz[name] for name in npz.files}
    except FileNotFoundError:
        raise UserError(f"{path}: no such slot file") from None
    except (OSError, ValueError, zipfile.BadZipFile, EOFError):
        raise UserError(f"{path}: not a slot file (not an .npz archive of a saved slot)") from None
    cache = net.slots[index].cache
    meta = _meta(path, arrays)
    for key, want, what in (("model", fingerprint, "model"), ("n_ctx", cache.n_ctx, "context size (--ctx)"),
                            ("kv_type", cache.kv_type, "KV type (--kv-type)")):
        if meta.get(key) != want:
            raise UserError(f"{path}: saved for another {what}: {meta.get(key)!r}, this engine has {want!r}")
    if meta["n_past"] > cache.n_ctx or any(t >= net.args.vocab_size for t in meta["ids"]):
        raise UserError(f"{path}: broken slot file (its tokens do not fit the model)")
    held = meta.get("held")
    if not isinstance(held, list) or not all(
            isinstance(h, list) and len(h) == 2 and all(isinstance(x, int) and -1 <= x <= cache.n_ctx for x in h)
            for h in held):
        raise UserError(f"{path}: broken slot file (the positions its layers hold are out of range)")
    held = [tuple(h) for h in held]
    for store, layer, array in _staged(path, cache, arrays, held):
        np.copyto(store[layer][: len(array)], array)
    cache.held = held                                   # type: ignore[assignment]
    cache.drop_checkpoints()                            # they were the slot's former context's
    cache.checkpoint()                                  # a recurrent state: the restored one is one to go back to
    slot = net.slots[index]
    slot.n_past, slot.ids[:] = meta["n_past"], meta["ids"]
    return slot.n_past


def _meta(path: Path, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    try:
        meta = json.loads(arrays["meta"].tobytes())
    except (KeyError, ValueError) as exc:
        raise UserError(f"{path}: not a slot file (no readable meta: {exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise UserError(f"{path}: not a slot file")
    if meta.get("version") != VERSION:
        raise UserError(f"{path}: slot file version {meta.get('version')!r}, this engine reads {VERSION}")
    ids, n_past = meta.get("ids"), meta.get("n_past")
    if not isinstance(n_past, int) or not isinstance(ids, list) or len(ids) != n_past \
            or not all(isinstance(t, int) and t >= 0 for t in ids):
        raise UserError(f"{path}: broken slot file (n_past and ids disagree)")
    return meta


def _staged(path: Path, cache: Any, arrays: dict[str, np.ndarray],
            held: list[tuple[int, int]]) -> list[tuple[list[np.ndarray], int, np.ndarray]]:
    """(the cache's list of arrays, layer, the file's array) of every array, each checked against the
    cache's (type, shape) before any is copied in."""
    if len(held) != len(cache.held):
        raise UserError(f"{path}: the file has {len(held)} layers, the model {len(cache.held)}")
    staged = []
    for layer in range(len(held)):
        names = (("conv", cache.conv), ("ssm", cache.ssm)) if cache.recurrent[layer] is not None else \
            (("k", cache.k),) + (() if cache.layout.values_in_keys else (("v", cache.v),))
        for name, store in names:
            array, mine = arrays.get(f"{name}.{layer}"), store[layer]
            if array is None or array.dtype != mine.dtype or array.shape[1:] != mine.shape[1:] \
                    or len(array) > len(mine):
                raise UserError(f"{path}: broken slot file ({name}.{layer} does not fit the model's KV cache)")
            staged.append((store, layer, array))
    return staged
