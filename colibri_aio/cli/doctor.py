"""``doctor``: read-only checks of this machine and a model, one verdict per line.

Nothing here writes anything: it opens the model read-only, sets up (and
closes) an io_uring ring and a small buffer pool, and reads a few experts.
"""
from __future__ import annotations

import asyncio
import os
import random
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from colibri_aio.errors import UserError
from colibri_aio.gguf.model import Model, load
from colibri_aio.io.modelfile import ModelFile
from colibri_aio.io.reader import ExpertReader
from colibri_aio.engine.memory import memory_limits
from colibri_aio.kernels.backend import open_kernels
from colibri_aio.engine.plan import gb

Verdict = Literal["ok", "warn", "fail"]
PROBE_SECONDS = 1.0
PROBE_SLOTS = 16


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    verdict: Verdict
    detail: str

    def line(self) -> str:
        return f"{self.verdict.upper():4}  {self.name:<16} {self.detail}"


def check_gguf(path: Path) -> tuple[Check, Model | None]:
    try:
        model = load(path, resident=False)
    except UserError as exc:
        return Check("gguf", "fail", str(exc)), None
    a = model.args
    return Check("gguf", "ok", f"{path.name}: {a.architecture}, {a.block_count} layers, {a.expert_count} experts "
                               f"top-{a.expert_used_count}, {gb(model.identity.size)}, trunk "
                               f"{gb(model.trunk_nbytes)}, expert {gb(model.expert_nbytes_max)}"), model


def check_memlock() -> Check:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit = "unlimited" if soft == resource.RLIM_INFINITY else gb(soft)
    if os.geteuid() == 0 or soft == resource.RLIM_INFINITY:
        return Check("memlock", "ok", f"RLIMIT_MEMLOCK {limit}; root may register any pool with io_uring")
    return Check("memlock", "warn", f"RLIMIT_MEMLOCK {limit}: pools larger than this are read without "
                                    f"registered buffers (raise it with ulimit -l to register)")


def check_memory() -> Check:
    m = memory_limits()
    cg = f"cgroup limit {gb(m.cgroup_limit)} ({m.cgroup_source})" if m.cgroup_limit else m.cgroup_source
    return Check("memory", "ok", f"RAM {gb(m.total)}, available {gb(m.available)}, {cg}; usable {gb(m.usable)}")


def check_o_direct(path: Path) -> Check:
    f = ModelFile.open(path, direct=True)
    try:
        if f.direct:
            return Check("o_direct", "ok", f"{path.parent}: O_DIRECT reads bypass the page cache")
        return Check("o_direct", "warn", f"{path.parent}: {f.direct_reason}; buffered reads instead")
    finally:
        f.close()


def _matrix_types(model: Model) -> set:
    """The types of every matrix the kernels multiply (trunk products and each layer's experts)."""
    mats = [model.token_embd, model.output]
    mats += [w for b in model.blocks for w in (b.attn_q, b.attn_k, b.attn_v, b.attn_output)]
    return {m.ggml_type for m in mats} | {r.ggml_type for layer in model.experts for r in layer[0].ranges}


def check_kernels(model: Model | None) -> Check:
    """Which kernels ``--kernels auto`` picks and why (NumPy is slow: a warning), and whether they
    multiply every type in the model."""
    kernels = open_kernels("auto")
    try:
        detail = f"--kernels auto picks {kernels.name}: {kernels.reason}"
        if model is not None:
            missing = sorted({t.name for t in _matrix_types(model)} - {t.name for t in kernels.types})
            if missing:
                return Check("kernels", "fail", f"{detail}; no kernel for {', '.join(missing)}")
        return Check("kernels", "ok" if kernels.name == "ggml" else "warn", detail)
    finally:
        kernels.close()


async def check_backend(model: Model) -> tuple[Check, Check]:
    """Which backend ``--io auto`` picks and why, and a short read-speed probe with it."""
    reader = await ExpertReader.open(model.path, model.expert_nbytes_max, PROBE_SLOTS, backend="auto")
    try:
        verdict: Verdict = "ok" if reader.backend == "uring" else "warn"
        backend = Check("io backend", verdict, f"--io auto picks {reader.backend}: {reader.backend_reason}")
        return backend, await _probe(model, reader)
    finally:
        await reader.aclose()


async def _probe(model: Model, reader: ExpertReader) -> Check:
    """Random expert reads, PROBE_SLOTS in flight, for about PROBE_SECONDS."""
    locs = [loc for layer in model.experts for loc in layer]
    rng = random.Random(0)
    done = nbytes = 0
    t0 = time.perf_counter()

    async def one() -> None:
        nonlocal done, nbytes
        while time.perf_counter() - t0 < PROBE_SECONDS:
            with await reader.read(rng.choice(locs)) as lease:
                nbytes += lease.location.nbytes
                done += 1

    await asyncio.gather(*(one() for _ in range(PROBE_SLOTS)))
    dt = time.perf_counter() - t0
    note = "" if model.identity.size > 256 << 20 else " (small file: partly served from the device cache)"
    return Check("read speed", "ok", f"{done} random expert reads in {dt:.2f} s: {nbytes / dt / 1e9:.2f} GB/s, "
                                     f"{done / dt:.0f} experts/s, {PROBE_SLOTS} in flight{note}")


def run_checks(path: Path | None, emit: Callable[[Check], None]) -> int:
    """Run every check, emitting each as it finishes; returns 2 if any failed, else 0."""
    checks: list[Check] = [check_memory(), check_memlock()] + ([check_kernels(None)] if path is None else [])
    for c in checks:
        emit(c)
    failed = False
    if path is not None:
        gguf, model = check_gguf(path)
        emit(gguf)
        failed = gguf.verdict == "fail"
        if model is not None:
            emit(check_kernels(model))
            emit(check_o_direct(path))
            for c in asyncio.run(check_backend(model)):
                emit(c)
    return 2 if failed else 0
