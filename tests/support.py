"""Shared test helpers: fixture paths and a way to run the CLI as a user would."""
from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
ORACLE = FIXTURES / "oracle"


def _avx512() -> bool:
    from colibri_aio.cpu import flags

    return "avx512f" in flags()


# The llama.cpp oracles under fixtures/oracle were made on an AVX-512 host. ggml sums a product's blocks in
# another order where AVX-512 is missing, and llama.cpp with it: on an AMD EPYC with AVX2 only, llama.cpp's own
# logits of colibri-tiny-q8_0 are 3.1e-4 x max|logit| from the AVX-512 oracle on one sequence, where ours
# equal llama.cpp's on that host bit for bit. A comparison held to the AVX-512 host's rounding takes
# ``other_cpu`` there (each use says what it measured).
AVX512 = _avx512()


def oracle_tolerance(rel: float, other_cpu: float) -> float:
    """``rel`` on a CPU of the oracle's class (AVX-512), ``other_cpu`` on one without AVX-512."""
    return rel if AVX512 else max(rel, other_cpu)


def _uring_problem() -> str | None:
    """Why io_uring cannot be set up in this process, or None."""
    from colibri_aio.io.ring import Ring
    try:
        Ring(8).close()
    except OSError as exc:
        return f"io_uring cannot be set up here ({exc})"
    return None


# io_uring is the engine's own binding over the kernel's system calls, so its tests run on every CPU; only a kernel
# or sandbox without io_uring skips them, and never in CI, whose machine has it: there a missing ring fails.
requires_uring = pytest.mark.skipif(not os.environ.get("CI") and _uring_problem() is not None,
                                    reason=str(_uring_problem()))


def fixture(name: str) -> Path:
    path = FIXTURES / name
    if not path.exists():
        pytest.fail(f"missing fixture {path}; regenerate with fixtures/make_fixtures.py")
    return path


def oracle_ids() -> list[list[int]]:
    return json.loads((ORACLE / "ids.json").read_text())["sequences"]


def family_stems() -> frozenset[str]:
    """The fixtures of fixtures/family_specs.py (converted by llama.cpp's converter, oracles on
    fixtures/oracle/family_ids.json), whatever their architecture; qwen3moe's tiny_* are not among them."""
    sys.path.insert(0, str(FIXTURES))
    try:
        from family_specs import FAMILIES
    finally:
        sys.path.remove(str(FIXTURES))
    return frozenset(stem for family in FAMILIES.values() for stem in family.stems)


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``python -m colibri_aio ARGS`` in a subprocess, as a user runs it."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "colibri_aio", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=FIXTURES.parent)


def main_in_process(*args: str) -> tuple[int, str, str]:
    """``python -m colibri_aio ARGS`` run by :func:`colibri_aio.cli.main.main` in this process:
    (exit status, stdout, stderr). Faster than a subprocess; logging is configured back afterwards."""
    import contextlib
    import io

    import structlog

    from colibri_aio.cli.main import main

    # Encoded as a process's streams are (UTF-8; strict on stdout, escapes on stderr), so text
    # that could not be printed fails here as it would in a terminal or a pipe.
    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict", write_through=True)
    err = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="backslashreplace", write_through=True)
    saved = structlog.get_config()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = main(list(args))
            except SystemExit as exc:
                status = exc.code if isinstance(exc.code, int) else 1
    finally:
        structlog.configure(**saved)
    return status, out.buffer.getvalue().decode(), err.buffer.getvalue().decode()


def model_logits(path: Path, ids: list[int]) -> np.ndarray:
    """Teacher-forced logits of every position of ``ids`` (one prefill) from the model at ``path``, with a
    float32 KV cache as the oracles keep theirs."""
    from colibri_aio.arch import build_net
    from colibri_aio.engine.mapped_source import MappedExpertSource
    from colibri_aio.gguf.model import load

    model = load(path)
    return teacher_forced(build_net(model, MappedExpertSource(model), kv_type="f32"), ids, decode=False)


def teacher_forced(net, ids: list[int], *, decode: bool) -> np.ndarray:
    """Logits of every position of ``ids`` from an empty context: all at once (prefill, matmul
    kernels) or one token at a time (decode, matvec kernels)."""
    net.reset()
    if not decode:
        return asyncio.run(net.forward(ids, logits="all"))

    async def one_by_one() -> np.ndarray:
        return np.stack([await net.forward([t]) for t in ids])

    return asyncio.run(one_by_one())


async def reference_logits(path: Path, ids: list[int], split: int = 12, kernels: str = "numpy") -> np.ndarray:
    """Logits of the plain mmap forward pass on ``kernels``: the first ``split`` ids as one batch, then the
    rest one by one."""
    from colibri_aio.arch import build_net
    from colibri_aio.engine.mapped_source import MappedExpertSource
    from colibri_aio.gguf.model import load
    from colibri_aio.kernels.backend import open_kernels
    from colibri_aio.kernels.threads import limit_blas_threads

    model = load(path)
    backend = open_kernels(kernels)
    # One OpenBLAS thread, as every engine runs (engine/opening.py): OpenBLAS 0.3.31 splits a small
    # product's work across threads in a way that changes its last bits, and the pool size is process-wide.
    limit_blas_threads(1)
    try:
        net = build_net(model, MappedExpertSource(model), kernels=backend)
        prefill = await net.forward(ids[:split], logits="all")
        decode = [await net.forward([t]) for t in ids[split:]]
    finally:
        backend.close()
    return np.concatenate([prefill, np.stack(decode)])


async def engine_logits(path: Path, ids: list[int], split: int = 12, kernels: str = "numpy", **placement):
    """(logits, engine) of ``Engine.open(path, kernels=kernels, **placement)``: the first ``split`` ids
    prefilled (batch-union path), then the rest decoded one by one (lookahead path). The engine is closed
    when this returns. NumPy kernels by default, as :func:`reference_logits`, so the two compare bit for bit."""
    from colibri_aio.engine.engine import Engine

    async with await Engine.open(path, kernels=kernels, **placement) as engine:
        engine.net.reset()
        prefill = await engine.net.forward(ids[:split], logits="all")
        decode = [await engine.net.forward([t]) for t in ids[split:]]
    return np.concatenate([prefill, np.stack(decode)]), engine


def rewrite_gguf(src: Path, dst: Path, *, keys: dict | None = None, drop_keys: tuple[str, ...] = (),
                 tensors=None) -> Path:
    """A copy of the GGUF ``src`` at ``dst`` with metadata ``keys`` set (int, float, str, bool or a list),
    ``drop_keys`` removed, and its tensors passed through ``tensors(name, array) -> [(name, array), ...]``
    (an F32 source), or ``[(name, array, ggml_type), ...]`` to store raw bytes as that type. Without
    ``tensors``, each tensor is copied as its bytes and type."""
    import gguf

    kinds = {bool: gguf.GGUFValueType.BOOL, int: gguf.GGUFValueType.UINT32,
             float: gguf.GGUFValueType.FLOAT32, str: gguf.GGUFValueType.STRING}
    keys = keys or {}
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(str(dst), keys.get("general.architecture",
                                                reader.fields["general.architecture"].contents()))
    _copy_keys(reader, writer, skip=(*drop_keys, *keys))
    for key, value in keys.items():
        if isinstance(value, list):
            writer.add_array(key, value)
        elif key != "general.architecture":
            writer.add_key_value(key, value, kinds[type(value)])
    for t in reader.tensors:
        kept = [(t.name, np.asarray(t.data), t.tensor_type)]
        for name, array, *raw in (tensors(t.name, np.asarray(t.data)) if tensors else kept):
            writer.add_tensor(name, np.ascontiguousarray(array), raw_dtype=raw[0] if raw else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def _copy_keys(reader, writer, skip=()) -> None:
    """Every metadata key of ``reader`` but ``skip`` (and the architecture, which the writer was made with)."""
    import gguf

    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in skip:
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)


def split_gguf(src: Path, dst: Path, *, max_tensors: int, small_first: bool = False) -> list[Path]:
    """``src`` split as gguf-split does, by gguf-py's writer: parts of at most ``max_tensors`` tensors, in table
    order, named ``<dst stem>-0000k-of-0000n.gguf``, every key in the first part, ``split.*`` keys in each;
    ``small_first``: a first part with the metadata and no tensor (gguf-split --no-tensor-first-split)."""
    import gguf

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents(),
                             split_max_tensors=max_tensors, small_first_shard=small_first)
    _copy_keys(reader, writer)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return writer.format_shard_names(dst)


async def greedy_generation(engine, ids: list[int], n: int, bias: dict[int, float],
                            **kw) -> tuple[list[int], list[float], int]:
    """Tokens, their log-probabilities and the cached prefix of one greedy ``engine.generate`` with ``bias``."""
    tokens, lps, cached = [], [], 0
    async for p in engine.generate(ids, max_tokens=n, logprobs=0, logit_bias=bias, **kw):
        tokens.append(p.token)
        lps.append(p.logprob)
        cached = p.cached_tokens
    return tokens, lps, cached


async def greedy_replay(engine, calls: list, n: int, bias: dict[int, float]) -> tuple[list[int], list[float]]:
    """A fresh context, the given forward calls (an int: rewind to it), then greedy decode of n tokens with
    ``bias`` on the logits, as :func:`greedy_generation` picks them (log-probabilities of the unbiased ones)."""
    engine.net.reset()
    for call in calls:
        if isinstance(call, int):
            engine.net.rewind(call)
        else:
            logits = await engine.net.forward(call)
    tokens, lps = [], []
    for _ in range(n):
        biased = logits.copy()
        for t, b in bias.items():
            biased[t] += np.float32(b)
        t = int(np.argmax(biased))
        x = logits.astype(np.float64) - logits.max()
        lps.append(float(x[t] - np.log(np.exp(x).sum())))
        tokens.append(t)
        logits = await engine.net.forward([t])
    return tokens, lps


def assert_refused_in_one_line(path: Path, phrase: str, tmp_path: Path) -> None:
    """Loading ``path`` is a ModelFormatError saying ``phrase``, and the CLI says it in one line, exit 2."""
    from colibri_aio.errors import ModelFormatError
    from colibri_aio.gguf.model import load

    with pytest.raises(ModelFormatError, match=re.escape(phrase)):
        load(path)
    status, _, err = main_in_process("logits", str(path), "--ids", "1,2", "--out", str(tmp_path / "x.npy"))
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and phrase in lines[0] and "Traceback" not in err, err
