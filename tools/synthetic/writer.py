"""Stream a GGUF to disk: tensor infos first, then each tensor's bytes in chunks.

The next chunk is generated while a worker thread writes the previous one
(file writes release the GIL), so RAM holds two chunks at a time whatever the
model size, and generation overlaps the disk.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

from synthetic.tensors import TensorPlan, tensor_chunks


@dataclass(frozen=True)
class WriteStats:
    nbytes: int
    seconds: float

    @property
    def bytes_per_second(self) -> float:
        return self.nbytes / self.seconds if self.seconds else 0.0


def _declare(writer: gguf.GGUFWriter, plan: TensorPlan) -> None:
    """Add one tensor info (shape in NumPy order, as GGUFWriter.add_tensor takes it)."""
    if plan.qtype == T.F32:
        writer.add_tensor_info(plan.name, plan.shape, np.dtype(np.float32), plan.nbytes)
    else:
        writer.add_tensor_info(plan.name, plan.shape, np.dtype(np.float32), plan.nbytes, raw_dtype=plan.qtype)


def _padding(position: int, alignment: int) -> bytes:
    return bytes(-position % alignment)


def write_gguf(path: Path, add_metadata: Callable[[gguf.GGUFWriter], None], plans: list[TensorPlan],
               seed: int, chunk_bytes: int = 16 << 20,
               progress: Callable[[str, int], None] | None = None, arch: str = "qwen3moe") -> WriteStats:
    """Write ``plans`` (bytes from :func:`tensor_chunks`) with the metadata ``add_metadata`` adds."""
    t0 = time.perf_counter()
    writer = gguf.GGUFWriter(str(path), arch=arch)
    add_metadata(writer)
    for plan in plans:
        _declare(writer, plan)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    fout = writer.fout[0]
    align = writer.data_alignment
    position = fout.tell()
    pending: Future[int] | None = None
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="gguf-write") as pool:
        def submit(data: bytes | np.ndarray) -> None:
            nonlocal pending, position
            if pending is not None:
                pending.result()  # at most one chunk in flight: bounded memory, errors surface here
            pending = pool.submit(fout.write, data)
            position += len(data) if isinstance(data, bytes) else data.nbytes

        submit(_padding(position, align))
        for plan in plans:
            for chunk in tensor_chunks(plan, seed, chunk_bytes):
                submit(chunk)
            submit(_padding(position, align))
            if progress is not None:
                progress(plan.name, position)
        if pending is not None:
            pending.result()
    writer.close()
    size = path.stat().st_size
    if size != position:
        raise RuntimeError(f"{path}: wrote {size} bytes, expected {position}")
    return WriteStats(size, time.perf_counter() - t0)
