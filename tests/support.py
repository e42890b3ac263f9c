"""Shared test helpers: fixture paths and a way to run the CLI as a user would."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
ORACLE = FIXTURES / "oracle"


def fixture(name: str) -> Path:
    path = FIXTURES / name
    if not path.exists():
        pytest.fail(f"missing fixture {path}; regenerate with fixtures/make_fixtures.py")
    return path


def oracle_ids() -> list[list[int]]:
    return json.loads((ORACLE / "ids.json").read_text())["sequences"]


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


@pytest.fixture(scope="module")
def numpy_kernels():
    """The reference kernels for a module's tests, whatever $COLIBRI_KERNELS says
    (``pytestmark = pytest.mark.usefixtures("numpy_kernels")`` with this name imported)."""
    from colibri_aio.kernels import backend

    backend.set_backend("numpy")
    yield
    backend.set_backend(os.environ.get("COLIBRI_KERNELS", "auto"))


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


def rewrite_gguf(src: Path, dst: Path, *, keys: dict | None = None, drop_keys: tuple[str, ...] = (),
                 tensors=None) -> Path:
    """A copy of the F32 GGUF ``src`` at ``dst`` with metadata ``keys`` set (int, float, str or bool),
    ``drop_keys`` removed, and its tensors passed through ``tensors(name, array) -> [(name, array), ...]``."""
    import gguf

    kinds = {bool: gguf.GGUFValueType.BOOL, int: gguf.GGUFValueType.UINT32,
             float: gguf.GGUFValueType.FLOAT32, str: gguf.GGUFValueType.STRING}
    keys = keys or {}
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(str(dst), keys.get("general.architecture",
                                                reader.fields["general.architecture"].contents()))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop_keys or key in keys:
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for key, value in keys.items():
        if key != "general.architecture":
            writer.add_key_value(key, value, kinds[type(value)])
    for t in reader.tensors:
        for name, array in (tensors(t.name, np.asarray(t.data)) if tensors else [(t.name, np.asarray(t.data))]):
            writer.add_tensor(name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
