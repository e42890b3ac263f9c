"""``doctor``: read-only checks of this machine and a model, one verdict per line.

It opens the model read-only, sets up (and closes) an io_uring ring and a
small buffer pool, and reads a few experts. The one thing it writes is the
native probes' verdicts (:mod:`colibri_aio.probes`): it runs them afresh,
each in its own child process, and keeps what they found for later runs.
``--verify`` also checks where every tensor and expert range lies in the
file, that the special-token ids name tokens, that the tokenizer builds and
the chat template renders a short conversation, and decodes every tensor,
failing on values that are not finite.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import resource
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from colibri_aio import cpu, probes
from colibri_aio.cli.options import add_model, model_path
from colibri_aio.errors import UserError, one_line
from colibri_aio.gguf.model import Model, load
from colibri_aio.gguf.verify import layout_problems, scan, special_token_problems
from colibri_aio.io.modelfile import open_files
from colibri_aio.io.reader import ExpertReader
from colibri_aio.engine.memory import memory_limits
from colibri_aio.kernels.backend import open_kernels
from colibri_aio.engine.plan import gb
from colibri_aio.io.align import slot_nbytes_for

Verdict = Literal["ok", "warn", "fail"]
PROBE_SECONDS = 1.0
PROBE_SLOTS = 16


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    verdict: Verdict
    detail: str

    def line(self) -> str:
        return f"{self.verdict.upper():4}  {self.name:<16} {one_line(self.detail)}"


def check_gguf(path: Path) -> tuple[Check, Model | None]:
    try:
        model = load(path, resident=False)
    except UserError as exc:
        return Check("gguf", "fail", str(exc)), None
    a = model.args
    parts = f" in {len(model.paths)} parts" if len(model.paths) > 1 else ""
    return Check("gguf", "ok", f"{path.name}: {a.architecture}, {a.layers_text}, {a.expert_count} experts "
                               f"top-{a.expert_used_count}, {gb(model.file_nbytes)}{parts}, trunk "
                               f"{gb(model.trunk_nbytes)}, expert {gb(model.expert_nbytes_max)} (pool slot "
                               f"{gb(slot_nbytes_for(model.expert_nbytes_max))} with O_DIRECT alignment)"), model


def check_values(model: Model, progress: Callable[[int, int], None] | None = None) -> list[Check]:
    """Every tensor decoded: one failing check per tensor with a value that is not finite, else one OK."""
    found = [Check("values", "fail", f"{bad.path}: {bad.describe()}") for bad in scan(model.reader, progress)]
    n = len(model.reader.tensors)
    return found or [Check("values", "ok", f"{n} tensors decoded: every value is finite")]


def check_layout(model: Model) -> list[Check]:
    """Every tensor and expert byte range inside the data section, none over another."""
    problems = layout_problems(model.reader, model.experts, [os.stat(p).st_size for p in model.paths])
    if problems:
        return [Check("layout", "fail", p) for p in problems]
    n_ranges = 3 * sum(len(layer) for layer in model.experts)
    starts = ", ".join(str(part.data_offset) for part in model.reader.parts)
    where = (f"the data section (from byte {starts})" if len(model.paths) == 1
             else f"the data sections of their {len(model.paths)} parts (from bytes {starts})")
    return [Check("layout", "ok", f"{len(model.reader.tensors)} tensors and {n_ranges} expert ranges lie inside "
                                  f"{where}, none over another")]


PROBE_CHAT = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Hello!"}]


def check_text(model: Model) -> list[Check]:
    """Special-token ids in the vocabulary, the tokenizer built, the chat template rendered once."""
    from colibri_aio.text.tokenizer import Tokenizer

    bad = special_token_problems(model.reader)
    # an id outside the vocabulary is ignored (llama.cpp's rule), so the model runs: worth knowing, not failing
    checks = [Check("special tokens", "warn", p) for p in bad]
    try:
        tokenizer = Tokenizer.from_gguf(model.reader)
    except UserError as exc:
        return checks + [Check("tokenizer", "fail", str(exc))]
    if not bad:
        checks.append(Check("special tokens", "ok", "every tokenizer.ggml.*_token_id names a token"))
    checks.append(Check("tokenizer", "ok", f"builds: {tokenizer.vocab_size} tokens, {len(tokenizer.eog_ids)} "
                                            f"end-of-generation ids"))
    if tokenizer.spec.chat_template is None:
        return checks + [Check("chat template", "warn", "none in the file: chat prompts are refused")]
    try:
        text = tokenizer.apply_chat_template(PROBE_CHAT)
    except UserError as exc:
        return checks + [Check("chat template", "fail", str(exc))]
    return checks + [Check("chat template", "ok", f"renders a two-message conversation ({len(text)} characters)")]


def check_cpu() -> Check:
    return Check("cpu", "ok", cpu.describe())


def check_probes() -> list[Check]:
    """Each compiled backend tried afresh in a child process: ok, or warn with why the engine falls back."""
    fallbacks = {"io_uring": "reads use thread-pool pread", "ggml": "products use the NumPy kernels"}
    checks = []
    for backend in probes.PROBES:
        found = probes.verdict(backend, fresh=True)
        detail = found.detail if found.ok else f"{found.line()}; {fallbacks.get(backend, 'not used')}"
        checks.append(Check(f"probe {backend}", "ok" if found.ok else "warn", detail))
        probes.reported(backend)
    return checks


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


def check_o_direct(paths: Sequence[Path]) -> Check:
    """Whether every file of the model (each part of a split one) takes O_DIRECT reads."""
    files = open_files(paths, direct=True)
    try:
        for path, f in zip(paths, files):
            if not f.direct:
                return Check("o_direct", "warn", f"{path.parent}: {f.direct_reason}; buffered reads instead")
        return Check("o_direct", "ok", f"{paths[0].parent}: O_DIRECT reads bypass the page cache")
    finally:
        for f in files:
            f.close()


def _matrix_types(model: Model) -> set:
    """The types of every matrix the kernels multiply (trunk products and each layer's experts)."""
    mats = [model.token_embd, model.output, *(m for b in model.blocks for m in b.matrices())]
    return {m.ggml_type for m in mats} | {r.ggml_type for layer in model.experts if layer for r in layer[0].ranges}


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
    reader = await ExpertReader.open(model.paths, model.expert_nbytes_max, PROBE_SLOTS, backend="auto")
    try:
        verdict: Verdict = "ok" if reader.backend == "uring" else "warn"
        backend = Check("io backend", verdict, f"--io auto picks {reader.backend}: {reader.backend_reason} (for "
                                               "experts that do not all fit; those that do stay in the page cache)")
        return backend, await _probe(model, reader)
    finally:
        await reader.aclose()


async def _probe(model: Model, reader: ExpertReader) -> Check:
    """Random expert reads, PROBE_SLOTS in flight, for about PROBE_SECONDS."""
    locs = [loc for layer in model.experts for loc in layer]
    rng = random.Random(0)
    done = nbytes = 0
    t0 = time.perf_counter()

    async def one(slot: int) -> None:  # each worker reads into its own slot
        nonlocal done, nbytes
        while time.perf_counter() - t0 < PROBE_SECONDS:
            loc = rng.choice(locs)
            await reader.start(loc, slot)
            nbytes += loc.nbytes
            done += 1

    await asyncio.gather(*(one(slot) for slot in range(PROBE_SLOTS)))
    dt = time.perf_counter() - t0
    note = "" if model.file_nbytes > 256 << 20 else " (small file: partly served from the device cache)"
    return Check("read speed", "ok", f"{done} random expert reads in {dt:.2f} s: {nbytes / dt / 1e9:.2f} GB/s, "
                                     f"{done / dt:.0f} experts/s, {PROBE_SLOTS} in flight{note}")


def run_checks(path: Path | None, emit: Callable[[Check], None], *, verify: bool = False,
               progress: Callable[[int, int], None] | None = None) -> int:
    """Run every check, emitting each as it finishes; returns 2 if any failed, else 0.

    ``verify`` adds :func:`check_layout`, :func:`check_text` and :func:`check_values` (reads the whole file).
    """
    emit(check_cpu())
    for c in check_probes():
        emit(c)
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
            emit(check_o_direct(model.paths))
            for c in asyncio.run(check_backend(model)):
                emit(c)
            if verify:
                for c in [*check_layout(model), *check_text(model)]:
                    emit(c)
                    failed = failed or c.verdict == "fail"
                for c in check_values(model, progress):
                    emit(c)
                    failed = failed or c.verdict == "fail"
    return 2 if failed else 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Declare ``doctor`` and its options."""
    p = sub.add_parser("doctor", help="read-only checks: model file, io_uring, O_DIRECT, memlock, memory, read speed",
                       description="Check this machine and a model (default: the shipped one); one verdict per line. "
                                   "Exit status 2 when a check fails.")
    add_model(p)
    p.add_argument("--verify", action="store_true",
                   help="also decode every tensor and fail on values that are not finite (reads the whole file)")
    p.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    """Print every verdict on stdout; a failed check is also the one-line error of exit status 2."""
    from colibri_aio.models import default_model_path

    def progress(done: int, total: int) -> None:
        sys.stderr.write(f"\r\033[Kverify {done / total:.0%}" + ("\r\033[K" if done >= total else ""))
        sys.stderr.flush()

    failed: list[Check] = []

    def emit(check: Check) -> None:
        print(check.line(), flush=True)
        if check.verdict == "fail":
            failed.append(check)

    status = run_checks(model_path(args) or default_model_path(), emit, verify=args.verify,
                        progress=progress if sys.stderr.isatty() else None)
    if failed:  # the verdicts are on stdout; the error path's one line on stderr, as for every command
        more = f" (and {len(failed) - 1} more failed checks)" if len(failed) > 1 else ""
        raise UserError(f"doctor: {failed[0].name}: {failed[0].detail}{more}")
    return status
