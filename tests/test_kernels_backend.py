"""Choosing kernels: each engine owns its backend, auto falls back with its reason, a backend asked
for by name that cannot run is one line and exit 2, and importing the package chooses nothing."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import numpy as np
import pytest

from colibri_aio.engine.engine import Engine
from colibri_aio.errors import UserError
from colibri_aio.kernels import backend
from colibri_aio.kernels.backend import KernelsUnavailable, NumpyKernels, open_kernels

from support import FIXTURES, fixture, oracle_ids, run_cli


@pytest.fixture
def no_ggml(tmp_path, monkeypatch) -> dict[str, str]:
    """An environment whose ``ggml`` package fails to import, as on a machine without ggml-python;
    in this process too (for in-process checks), and as env for subprocesses."""
    fake = tmp_path / "ggml"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('ggml-python is not installed here')\n")
    monkeypatch.setitem(sys.modules, "colibri_aio.kernels.ggml_cpu", None)  # import -> ImportError
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}


def test_importing_the_package_sets_no_environment_and_loads_no_kernel_library() -> None:
    code = ("import os, sys; before = dict(os.environ); import colibri_aio, colibri_aio.cli.main;"
            "assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items());"
            "bad = [m for m in ('numba', 'ggml', 'llvmlite') if m in sys.modules]; assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_help_imports_no_compiled_kernels() -> None:
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "colibri_aio", "--help"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    imported = {line.split("|")[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "colibri_aio" in imported
    assert not {m for m in imported if m.split(".")[0] in ("numba", "llvmlite", "ggml")}


def test_auto_falls_back_to_numpy_with_the_reason(no_ggml) -> None:
    k = open_kernels("auto")
    assert isinstance(k, NumpyKernels)
    assert "ggml-python unavailable" in k.reason and "NumPy" in k.reason


def test_ggml_asked_for_by_name_is_refused_when_it_cannot_load(no_ggml) -> None:
    with pytest.raises(KernelsUnavailable, match="ggml-python unavailable"):
        open_kernels("ggml")
    with pytest.raises(UserError, match="--kernels ggml"):
        asyncio.run(Engine.open(fixture("tiny_q8_0.gguf"), kernels="ggml"))


def test_cli_names_the_fallback_and_refuses_an_unusable_backend(no_ggml) -> None:
    env = no_ggml
    r = subprocess.run([sys.executable, "-m", "colibri_aio", "run", "--model", str(fixture("tiny_q8_0.gguf")),
                        "--prompt", "x", "--max-tokens", "2", "--kernels", "ggml"],
                       capture_output=True, text=True, env=env, cwd=FIXTURES.parent)
    assert r.returncode == 2
    # ggml is tried in a child first (colibri_aio.probes): its import error is the reason given
    assert len(r.stderr.strip().splitlines()) == 1 and "ggml-python is not installed here" in r.stderr
    r = subprocess.run([sys.executable, "-m", "colibri_aio", "-v", "run", "--model", str(fixture("tiny_q8_0.gguf")),
                        "--prompt", "x", "--max-tokens", "2"], capture_output=True, text=True, env=env,
                       cwd=FIXTURES.parent)
    assert r.returncode == 0, r.stderr
    assert "kernels numpy;" in r.stderr and "ggml-python is not installed here" in r.stderr
    r = subprocess.run([sys.executable, "-m", "colibri_aio", "doctor", str(fixture("tiny_q8_0.gguf"))],
                       capture_output=True, text=True, env=env, cwd=FIXTURES.parent)
    assert any(line.startswith("WARN") and "kernels" in line and "ggml-python is not installed here" in line
               for line in r.stdout.splitlines()), r.stdout


def test_unknown_backend_is_a_user_error() -> None:
    r = run_cli("run", "--prompt", "x", "--kernels", "numba")
    assert r.returncode == 2 and "invalid choice" in r.stderr
    with pytest.raises(UserError, match="unknown kernels"):
        asyncio.run(Engine.open(fixture("tiny_q8_0.gguf"), kernels="numba"))


def test_every_backend_is_named_and_auto_prefers_ggml() -> None:
    assert set(backend.NAMES) == {"auto", "ggml", "numpy"}
    k = open_kernels("auto")
    try:
        if k.name == "numpy":
            pytest.skip(k.reason)
        assert k.name == "ggml" and "faster than NumPy" in k.reason
    finally:
        k.close()


async def test_two_engines_in_one_process_keep_their_own_kernels() -> None:
    """The backend belongs to the engine: opening a second one with other kernels changes nothing
    for the first."""
    ids = oracle_ids()[0][:8]
    path = fixture("tiny_q8_0.gguf")
    async with await Engine.open(path, kernels="numpy") as a:
        want = await a.logits(ids)
        async with await Engine.open(path, kernels="ggml") as b:
            assert a.kernels.name == "numpy" and b.kernels.name == "ggml"
            other = await b.logits(ids)
            assert np.array_equal(await a.logits(ids), want)
        assert not np.array_equal(other, want)  # ggml rounds activations: the two really differ
        assert np.array_equal(await a.logits(ids), want)
