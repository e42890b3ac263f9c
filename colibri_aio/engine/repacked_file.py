"""Routed experts repacked once, into a file of their own: later runs read repacked bytes straight in.

Repacking experts as they land (:mod:`colibri_aio.engine.packing`) costs every
cold start the repacking and the fresh memory of every expert that lands.
``python -m colibri_aio repack MODEL`` pays that once: it writes each of the
model's files again as a sparse file in the cache folder, holding only the
routed experts, at the GGUF's own offsets, repacked where
:class:`~colibri_aio.kernels.ggml_cpu.ExpertPacker` repacks them (the others
copied as they are). An engine reads its experts from that file when one
matches (:func:`find`) unless ``COLIBRI_GGML_REPACK_EXPERTS=off``: through the
page cache or into the pool like the GGUF's, already in the kernels' layout.

The file's name carries what its bytes depend on: the model (its header
fingerprint, and each part's size and modification time) and the layout
(ggml's version, the instruction sets it was built for, the types
repacked). Any change gives another name, so a file that no longer matches
is never read; it is written to a temporary name and renamed whole.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from colibri_aio.cachefiles import cache_dir
from colibri_aio.gguf.fingerprint import model_fingerprint
from colibri_aio.gguf.model import Model
from colibri_aio.kernels.qtensor import QTensor

FORMAT = 1     # the layout of the file itself (sparse, the GGUF's offsets); part of every name


def layout_key(packer: object) -> str:
    """What repacked bytes depend on besides the model: ggml's version, its build's instruction sets and the
    types ``packer`` repacks."""
    from colibri_aio.kernels import ggml_cpu

    types = "/".join(sorted(t.name for t in packer.types))  # type: ignore[attr-defined]
    text = f"{FORMAT} {ggml_cpu.version()} {'/'.join(ggml_cpu.built_features())} {types}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def paths_for(model: Model, key: str) -> list[Path]:
    """Where the repacked experts of each of ``model``'s files live for layout ``key``."""
    h = hashlib.sha256(model_fingerprint(model).encode())
    for path in model.paths:
        st = os.stat(path)
        h.update(f"{st.st_size} {st.st_mtime_ns}\n".encode())
    name = h.hexdigest()[:32]
    return [cache_dir("repacked", f"{name}-{key}.{part}.experts") for part in range(len(model.paths))]


def any_for(model: Model) -> bool:
    """Whether some repacked experts file of ``model`` (whatever its layout) exists: asked before the kernels
    are loaded, so that a model without one never waits for them."""
    first = paths_for(model, "*")[0]
    return any(first.parent.glob(first.name))


def find(model: Model, packer: object) -> list[Path] | None:
    """The repacked experts file(s) of ``model`` for ``packer``'s layout, or None when there are none whole."""
    paths = paths_for(model, layout_key(packer))
    try:
        if all(p.stat().st_size == os.stat(src).st_size for p, src in zip(paths, model.paths)):
            return paths
    except OSError:
        pass
    return None


def write(model: Model, packer: object, progress: Callable[[int, int], None] | None = None) -> list[Path]:
    """Write ``model``'s routed experts, repacked by ``packer``, to :func:`paths_for`; returns the paths.
    Each file is written under a temporary name and renamed when whole (an interrupted or failed write
    leaves nothing that :func:`find` would take)."""
    paths = paths_for(model, layout_key(packer))
    paths[0].parent.mkdir(parents=True, exist_ok=True)
    temps = [p.with_name(f".{p.name}.{os.getpid()}.tmp") for p in paths]
    sources = [os.open(p, os.O_RDONLY) for p in model.paths]
    sinks: list[int] = []
    try:
        for temp, src in zip(temps, model.paths):
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            sinks.append(fd)
            os.ftruncate(fd, os.stat(src).st_size)       # sparse: only the experts' ranges take disk space
        locations = [loc for layer in model.experts for loc in layer]
        for n, loc in enumerate(locations, 1):
            for r in loc.ranges:
                raw = np.frombuffer(bytearray(os.pread(sources[r.file], r.nbytes, r.offset)), np.uint8)
                if raw.size != r.nbytes:
                    raise OSError(f"{model.paths[r.file]}: short read of layer {loc.layer} expert {loc.expert} "
                                  f"at offset {r.offset}")
                w = packer.pack(QTensor(raw, r.ggml_type, r.shape))  # type: ignore[attr-defined]
                if os.pwrite(sinks[r.file], w.data, r.offset) != r.nbytes:
                    raise OSError(f"{temps[r.file]}: short write at offset {r.offset}")
            if progress is not None:
                progress(n, len(locations))
        for fd in sinks:
            os.fsync(fd)
        for temp, path in zip(temps, paths):
            os.replace(temp, path)
        return paths
    finally:
        for fd in (*sources, *sinks):
            os.close(fd)
        for temp in temps:
            if temp.exists():
                temp.unlink()
