"""Opening a model, with the disk and both cores busy from the start.

The header is parsed first (it says where everything is). Then, side by side:

- the resident trunk is read with large aligned reads (worker threads);
- the engine's kernels are loaded (ggml's library and thread pool; a worker thread);
- the tokenizer is read from its cache, or built and cached (a worker thread);
- on the event loop, the plan is made and the expert reader opens its pool;
  once the trunk is read, the warm start begins streaming experts into it.

Each step's time is kept in :class:`OpenTimings` (logged, and in receipts);
the steps overlap, so they add up to more than the whole. The worker threads
are tasks of the engine's :class:`~colibri_aio.engine.tasks.EngineTasks`.
"""
from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from colibri_aio.engine.history import HistoryFile
from colibri_aio.engine.placement import Placement, open_source
from colibri_aio.engine.plan import Plan, gb
from colibri_aio.engine.repacked_file import any_for as any_repacked, find as find_repacked
from colibri_aio.engine.scheduler import CachedExpertSource
from colibri_aio.engine.tasks import EngineTasks
from colibri_aio.settings import Settings
from colibri_aio.errors import UserError
from colibri_aio.gguf.model import Model, Progress, load, with_resident_trunk
from colibri_aio.kernels.backend import NAMES as KERNEL_NAMES, Kernels, KernelsUnavailable, open_kernels
from colibri_aio.kernels.threads import get_num_threads, limit_blas_threads, set_num_threads
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


def _timed(func: Callable[..., T]) -> Callable[..., tuple[T, float]]:
    def run(*args: Any) -> tuple[T, float]:
        t0 = time.perf_counter()
        return func(*args), time.perf_counter() - t0
    return run


def kernels_name(name: str | None, settings: Settings) -> str:
    """The kernels asked for (``name``, else $COLIBRI_KERNELS, else auto); an unknown name is a user error."""
    name = name if name is not None else settings.get("kernels")
    if name not in KERNEL_NAMES:
        raise UserError(f"unknown kernels {name!r} (choose from {', '.join(KERNEL_NAMES)})")
    return name


def engine_kernels(name: str, settings: Settings, progress: Progress | None = None) -> Kernels:
    """The engine's own kernel backend ``name`` with its ``settings``; a backend asked for by name that cannot
    run here is a user error."""
    if progress is not None:
        progress("load kernels", 0, 1)
    if get_num_threads() != settings.kernel_threads:   # the NumPy kernels' pool, shared by the process
        set_num_threads(settings.kernel_threads)
    try:
        kernels = open_kernels(name, settings=settings)
    except KernelsUnavailable as e:
        raise UserError(f"--kernels {name}: {e}") from None
    # The kernels use the cores themselves; OpenBLAS threads inside NumPy calls would
    # oversubscribe them (evidence/kernels_20261129T181438Z.md: f32 GEMV 2.83 vs 0.24
    # G weights/s median with one OpenBLAS thread vs its default, same run).
    limit_blas_threads(1)
    if progress is not None:
        progress("load kernels", 1, 1)
    return kernels


async def _repacked_experts(model: Model, settings: Settings, backend: str, kernels: asyncio.Future[Any]
                            ) -> tuple[object | None, list[Path] | None]:
    """How this engine's experts are repacked: (the packer, or None for the file's layout; the repacked
    experts file the reader reads instead of the model's, or None).

    ``COLIBRI_GGML_REPACK_EXPERTS=on|all``: the kernels' packer, and its file when ``repack`` wrote one (else
    every expert is repacked as it lands). ``auto``: a file's packer when ``repack`` wrote one for this model
    (with on's types, or all's), else nothing is repacked. The kernels are waited for first only when a file
    may be read (which one fits is their packer's to say, and ggml is loaded only behind its probe)."""
    mode = settings.get("ggml_repack_experts")
    if mode == "off" or backend == "numpy" or (mode == "auto" and not any_repacked(model)):
        return None, None
    opened = (await kernels)[0]
    if opened.name != "ggml":
        return None, None
    from colibri_aio.kernels.ggml_cpu import expert_packer_for

    ours = opened.expert_packer()
    for packer in [ours] if mode in ("on", "all") else [expert_packer_for("on"), expert_packer_for("all")]:
        found = find_repacked(model, packer) if packer is not None else None
        if found is not None:
            return packer, found
    return ours, None


async def open_parts(path: str | os.PathLike[str], placement: Placement, tasks: EngineTasks, *,
                     settings: Settings, kernels: str | None = None, progress: Progress | None = None,
                     history: bool = True, tokenizer_cache: bool = True
                     ) -> tuple[Model, Tokenizer, CachedExpertSource, Plan, HistoryFile | None, Kernels, OpenTimings]:
    """Everything an engine is made of, read side by side (see the module's docstring), the worker threads
    run as ``tasks``, with the engine's ``settings``; ``kernels`` names the backend (auto|ggml|numpy; None:
    $COLIBRI_KERNELS or auto)."""
    t0 = time.perf_counter()
    backend = kernels_name(kernels, settings)
    described = load(path, resident=False)
    header_s = time.perf_counter() - t0
    store = HistoryFile.for_model(described) if history else None
    threads = [tasks.thread(_timed(with_resident_trunk), described, progress, settings.on("trunk_huge_pages"),
                            name="read trunk"),
               tasks.thread(_timed(engine_kernels), backend, settings, progress, name="load kernels"),
               tasks.thread(_timed(load_tokenizer), described, tokenizer_cache, name="load tokenizer")]
    source: CachedExpertSource | None = None
    try:
        t1 = time.perf_counter()
        packer, prepacked = await _repacked_experts(described, settings, backend, threads[1])
        source, plan = await open_source(described, placement, progress, store, fill_after=threads[0],
                                         expert_paths=prepacked)
        source_s = time.perf_counter() - t1
        (model, trunk_s), (opened, kernels_s), ((tokenizer, how), tokenizer_s) = await asyncio.gather(*threads)
        if tokenizer.vocab_size != model.args.vocab_size:
            raise UserError(f"{model.path}: tokenizer has {tokenizer.vocab_size} tokens, "
                            f"model {model.args.vocab_size}")
        source.use_packer(packer, model.args.expert_count, prepacked=prepacked is not None)
    except BaseException:
        # Nothing is left running: each thread's task ends when its thread does (cancelled or not), the
        # reads in flight are drained.
        await asyncio.wait(threads)
        kernels_thread = threads[1]
        if kernels_thread.done() and not kernels_thread.cancelled() and kernels_thread.exception() is None:
            kernels_thread.result()[0].close()
        if source is not None:
            await source.aclose()
        raise
    stats = model.trunk_read
    timings = OpenTimings(header_s, trunk_s, stats.nbytes if stats else 0, bool(stats and stats.direct),
                          tokenizer_s, how, kernels_s, source_s, time.perf_counter() - t0)
    log.info(timings.one_line(), **timings.as_dict())
    return model, tokenizer, source, plan, store, opened, timings
