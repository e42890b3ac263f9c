"""Opening a model, with the disk and both cores busy from the start.

The header is parsed first (it says where everything is). Then, side by side:

- the resident trunk is read with large aligned reads (worker threads);
- the kernels are compiled or loaded from numba's cache (a worker thread);
- the tokenizer is read from its cache, or built and cached (a worker thread);
- on the event loop, the plan is made, the expert reader opens its pool and
  the warm start begins streaming experts into it.

Each step's time is kept in :class:`OpenTimings` (logged, and in receipts);
the steps overlap, so they add up to more than the whole.
"""
from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from colibri_aio.engine.history import HistoryFile
from colibri_aio.engine.placement import Placement, open_source
from colibri_aio.engine.plan import Plan, gb
from colibri_aio.engine.scheduler import CachedExpertSource
from colibri_aio.errors import UserError
from colibri_aio.gguf.model import Model, Progress, load, with_resident_trunk
from colibri_aio.kernels import backend
from colibri_aio.logs import get_logger
from colibri_aio.text.cache import load_tokenizer
from colibri_aio.text.tokenizer import Tokenizer

log = get_logger("colibri_aio.engine")

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class OpenTimings:
    """Seconds each step of opening took; the steps after ``header_s`` run side by side."""

    header_s: float
    trunk_s: float
    trunk_bytes: int          # bytes read for the trunk (alignment and small gaps included)
    trunk_direct: bool        # read with O_DIRECT
    tokenizer_s: float
    tokenizer_source: str     # "cache", "built, cached" or "built"
    kernels_s: float
    source_s: float           # plan, buffer pool, expert reader, pinned experts
    total_s: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def one_line(self) -> str:
        rate = self.trunk_bytes / self.trunk_s / 1e9 if self.trunk_s else 0.0
        return (f"open {self.total_s:.2f} s: header {self.header_s:.2f} s, then side by side trunk "
                f"{gb(self.trunk_bytes)} in {self.trunk_s:.2f} s ({rate:.2f} GB/s"
                f"{', O_DIRECT' if self.trunk_direct else ''}), tokenizer {self.tokenizer_s:.2f} s "
                f"({self.tokenizer_source}), kernels {self.kernels_s:.2f} s, expert source {self.source_s:.2f} s")


def matrix_types(model: Model) -> tuple:
    """The ggml types the forward pass multiplies (to compile or load their kernels up front)."""
    mats = [model.output, *(m for b in model.blocks for m in b.matrices())]
    experts = {r.ggml_type for layer in model.experts if layer for r in layer[0].ranges}
    return tuple(sorted({m.ggml_type for m in mats} | experts))


def _timed(func: Callable[..., T]) -> Callable[..., tuple[T, float]]:
    def run(*args: Any) -> tuple[T, float]:
        t0 = time.perf_counter()
        return func(*args), time.perf_counter() - t0
    return run


def _warm_kernels(types: tuple, progress: Progress | None) -> None:
    if progress is not None:
        progress("load kernels", 0, 1)
    # Compiled kernels come from numba's on-disk cache (~1 s); only a cold cache compiles.
    backend.warm_up(types)
    if progress is not None:
        progress("load kernels", 1, 1)


async def open_parts(path: str | os.PathLike[str], placement: Placement, *, progress: Progress | None = None,
                     history: bool = True, tokenizer_cache: bool = True
                     ) -> tuple[Model, Tokenizer, CachedExpertSource, Plan, HistoryFile | None, OpenTimings]:
    """Everything an engine is made of, read side by side (see the module's docstring)."""
    t0 = time.perf_counter()
    described = load(path, resident=False)
    header_s = time.perf_counter() - t0
    store = HistoryFile.for_model(described) if history else None
    loop = asyncio.get_running_loop()
    threads = [loop.run_in_executor(None, _timed(with_resident_trunk), described, progress),
               loop.run_in_executor(None, _timed(_warm_kernels), matrix_types(described), progress),
               loop.run_in_executor(None, _timed(load_tokenizer), described, tokenizer_cache)]
    source: CachedExpertSource | None = None
    try:
        t1 = time.perf_counter()
        source, plan = await open_source(described, placement, progress, store)
        source_s = time.perf_counter() - t1
        (model, trunk_s), (_, kernels_s), ((tokenizer, how), tokenizer_s) = await asyncio.gather(*threads)
    except BaseException:
        # Nothing is left running: the worker threads end, the reads in flight are drained.
        await asyncio.wait(threads)
        if source is not None:
            await source.aclose()
        raise
    if tokenizer.vocab_size != model.args.vocab_size:
        await source.aclose()
        raise UserError(f"{model.path}: tokenizer has {tokenizer.vocab_size} tokens, model {model.args.vocab_size}")
    stats = model.trunk_read
    timings = OpenTimings(header_s, trunk_s, stats.nbytes if stats else 0, bool(stats and stats.direct),
                          tokenizer_s, how, kernels_s, source_s, time.perf_counter() - t0)
    log.info(timings.one_line(), **timings.as_dict())
    return model, tokenizer, source, plan, store, timings
