"""The command line, run as a user runs it (subprocesses)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from support import FIXTURES, ORACLE, fixture, oracle_ids, run_cli


def test_help_explains_every_command() -> None:
    r = run_cli("--help")
    assert r.returncode == 0
    for cmd in ("run", "logits", "trace", "trace-stats"):
        assert cmd in r.stdout
    r = run_cli("run", "--help")
    for opt in ("--model", "--prompt", "--chat", "--max-tokens", "--temperature", "--top-k", "--top-p", "--seed", "--io"):
        assert opt in r.stdout


def test_logits_writes_teacher_forced_rows(tmp_path) -> None:
    ids = oracle_ids()[1]
    out = tmp_path / "l.npy"
    r = run_cli("logits", str(fixture("tiny_f32.gguf")), "--ids", ",".join(map(str, ids)), "--out", str(out),
                "--kv-type", "f32")  # the oracle ran with a float32 KV cache
    assert r.returncode == 0, r.stderr
    got, want = np.load(out), np.load(ORACLE / "tiny_f32.transformers.npz")["seq1"]
    assert got.dtype == np.float32 and got.shape == (len(ids), 2048)
    assert float(np.abs(got - want).max()) <= 1e-4 * float(np.abs(want).max())


@pytest.mark.parametrize("kernels", ["numpy", "auto"])
def test_logits_of_k_quants_on_every_backend(kernels: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Q2_K file: the NumPy reference matches transformers (1e-4 x max|logit|); the default (ggml,
    which rounds activations as llama.cpp does) matches llama.cpp (3e-2, test_arch_qwen3moe's bound)."""
    monkeypatch.setenv("COLIBRI_KERNELS", kernels)
    oracle, tol = ("transformers", 1e-4) if kernels == "numpy" else ("llamacpp", 3e-2)
    want = np.load(FIXTURES / "quant_types" / "oracle" / f"ktiny_q2_k.{oracle}.npz")["seq0"]
    ids, out = oracle_ids()[0][: len(want)], tmp_path / "l.npy"
    r = run_cli("logits", str(fixture("quant_types/ktiny_q2_k.gguf")), "--ids", ",".join(map(str, ids)), "--out", str(out),
                "--kv-type", "f32")
    assert r.returncode == 0, r.stderr
    assert float(np.abs(np.load(out) - want).max()) <= tol * float(np.abs(want).max())


@pytest.mark.parametrize("ids", ["1,x,3", "", "5,99999"])
def test_logits_refuses_bad_ids(ids: str, tmp_path) -> None:
    r = run_cli("logits", str(fixture("tiny_f32.gguf")), "--ids", ids, "--out", str(tmp_path / "l.npy"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--ids" in r.stderr


@pytest.mark.parametrize("variable,value", [("COLIBRI_GGML_STEP", "graphs"), ("COLIBRI_GGML_REPACK", "yes"),
                                            ("COLIBRI_TRUNK_HUGE_PAGES", "1")])
def test_run_refuses_a_switch_set_to_an_unknown_value(variable: str, value: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A mistyped A/B switch is one line and exit 2, never a run of the default under another name."""
    monkeypatch.setenv(variable, value)
    r = run_cli("run", "--prompt", "hi", "--max-tokens", "2", "--kernels", "ggml")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert f"{variable}={value!r}" in r.stderr and "choose one of" in r.stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a device that is always full)")
def test_a_full_disk_is_one_line_and_exit_2(tmp_path) -> None:
    """Telemetry JSON or the generated text written to a full disk: one line naming what failed, exit 2."""
    r = run_cli("run", "--prompt", "hi", "--max-tokens", "4", "--stats-json", "/dev/full")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1] == \
        "colibri-aio: error: --stats-json /dev/full: cannot write (No space left on device)"
    assert "Traceback" not in r.stderr
    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, "-m", "colibri_aio", "run", "--prompt", "hi", "--max-tokens", "40"],
                           stdout=full, stderr=subprocess.PIPE, text=True, timeout=300, cwd=FIXTURES.parent)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines()[-1] == "colibri-aio: error: cannot write the output (No space left on device)"
    assert "Traceback" not in p.stderr and "Exception ignored" not in p.stderr


def test_run_streams_text_and_same_seed_gives_same_text() -> None:
    args = ("run", "--model", str(fixture("tiny_q8_0.gguf")), "--prompt", "The list type", "--max-tokens", "12",
            "--temperature", "0.8", "--top-p", "0.9", "--seed", "7")
    a, b = run_cli(*args), run_cli(*args)
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout and a.stdout.strip()
    assert "decode 12 tok" in a.stderr


def test_run_greedy_equals_argmax_of_logits(tmp_path) -> None:
    """run --temperature 0 must pick exactly the argmax the logits command reports."""
    model = str(fixture("tiny_f32.gguf"))
    r = run_cli("run", "--model", model, "--prompt", "def f(x):", "--max-tokens", "1")
    assert r.returncode == 0, r.stderr
    from colibri_aio.text.tokenizer import Tokenizer

    tok = Tokenizer.from_path(model)
    ids = tok.encode("def f(x):")
    run_cli("logits", model, "--ids", ",".join(map(str, ids)), "--out", str(tmp_path / "l.npy"))
    last = np.load(tmp_path / "l.npy")[-1]
    # prefill of `run` and `logits` use different kernels (matvec vs matmul for the
    # output head), so accept any token whose logit ties the maximum within 1e-4 x scale.
    tied = np.flatnonzero(last >= last.max() - 1e-4 * np.abs(last).max())
    assert r.stdout.rstrip("\n") in {tok.decode([int(t)], skip_special=True) for t in tied}


def test_run_chat_uses_the_template() -> None:
    from colibri_aio.text.tokenizer import Tokenizer

    model = str(fixture("tiny_q8_0.gguf"))
    r = run_cli("run", "--model", model, "--chat", "--prompt", "hi", "--max-tokens", "4")
    assert r.returncode == 0, r.stderr
    n = len(Tokenizer.from_path(model).encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"))
    assert f"prefill {n} tok" in r.stderr


def test_trace_and_stats(tmp_path) -> None:
    out = tmp_path / "t.jsonl"
    r = run_cli("trace", str(fixture("tiny_f32.gguf")), "--prompt", "The list type is", "--max-tokens", "5",
                "--out", str(out))
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    header, routes = lines[0], lines[1:]
    assert header["format"] == "colibri-aio-route-trace" and header["block_count"] == 2
    phases = [r["phase"] for r in routes]
    assert phases.count("decode") == 5 * 2 and phases[0] == "prefill"
    from colibri_aio.text.tokenizer import Tokenizer

    prompt = Tokenizer.from_path(fixture("tiny_f32.gguf")).encode("The list type is")
    assert [r["token"] for r in routes if r["phase"] == "prefill" and r["layer"] == 0] == prompt
    assert [r["pos"] for r in routes if r["layer"] == 0] == list(range(len(prompt) + 5))
    for rec in routes:
        assert len(rec["experts"]) == 2 and abs(sum(rec["weights"]) - 1) < 1e-5
        assert ("predicted" in rec) == (rec["layer"] == 0)
    r = run_cli("trace-stats", str(out), "--json")
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout)
    assert stats["positions"] == len(routes) // 2 and len(stats["layers"]) == 2
    assert {p["predictor"] for p in stats["predictors"]} == set(header["predictors"])


def _popen_run(tmp_path, *args: str, **kw) -> subprocess.Popen[bytes]:
    """The shipped model decodes ~60 tokens/s here: 240 tokens leave seconds to interrupt it mid-way."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            cwd=FIXTURES.parent, **kw)


def _history_runs(cache) -> int:
    paths = list((cache / "colibri_aio" / "usage").glob("*.json"))
    return json.loads(paths[0].read_text())["runs"] if paths else 0


@pytest.mark.parametrize("sig,status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_sigterm_cleans_up_like_ctrl_c(tmp_path, sig: signal.Signals, status: int) -> None:
    """Stopped mid-generation by either signal: quiet exit with its status, reads drained, history saved."""
    p = _popen_run(tmp_path, "-m", "colibri_aio", "run", "--max-tokens", "240", "--prefetch", "on")
    assert p.stdout is not None and p.stdout.read(1)          # the first token is out: generation is running
    p.send_signal(sig)
    out, err = p.communicate(timeout=120)
    assert p.returncode == status, err.decode()
    assert b"Traceback" not in err and b"decode 240 tok" not in err
    assert _history_runs(tmp_path) == 1                        # saved after the reads were drained


def test_a_closed_pipe_ends_the_run_quietly(tmp_path) -> None:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    r = subprocess.run(["bash", "-c", f"'{sys.executable}' -m colibri_aio run --max-tokens 240 | head -c 5;"
                        " echo \" status=${PIPESTATUS[0]}\""], capture_output=True, text=True, env=env,
                       cwd=FIXTURES.parent, timeout=120)
    assert r.stdout.endswith(" status=141\n"), r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "Broken" not in r.stderr and "Exception ignored" not in r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("[")   # the start line only
    assert _history_runs(tmp_path) == 1


def test_ctrl_c_inside_a_dataclass_being_built_exits_130(tmp_path) -> None:
    """Ctrl-C landing in the ``exec`` that builds a dataclass's ``__init__`` while the CLI imports: CPython notes it
    and, unless told otherwise, kills the process by SIGINT at exit (-2) whatever status the program returned."""
    script = tmp_path / "interrupted_import.py"
    script.write_text(
        "import builtins, sys\n"
        "from colibri_aio.__main__ import entry\n"
        "real_import = builtins.__import__\n"
        "def interrupted(name, *args, **kwargs):\n"
        "    if name == 'colibri_aio.cli.main':\n"
        "        exec('raise KeyboardInterrupt')\n"
        "    return real_import(name, *args, **kwargs)\n"
        "builtins.__import__ = interrupted\n"
        "sys.exit(entry())\n")
    # As a module (``-m``, like ``python -m colibri_aio``): a script's SystemExit takes another path in CPython.
    r = subprocess.run([sys.executable, "-m", script.stem], capture_output=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 130 and r.stdout == b"" and r.stderr == b"", r.stderr.decode()


def test_ctrl_c_while_importing_is_quiet(tmp_path) -> None:
    """-X importtime reports each import as it ends: interrupt once NumPy is in, while the engine still loads."""
    p = _popen_run(tmp_path, "-X", "importtime", "-m", "colibri_aio", "run", "--max-tokens", "2")
    assert p.stderr is not None
    for line in p.stderr:
        if line.split(b"|")[-1].strip() == b"numpy":
            p.send_signal(signal.SIGINT)
            break
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and b"Traceback" not in err and b"KeyboardInterrupt" not in err, err.decode()[-800:]
    assert out == b""
