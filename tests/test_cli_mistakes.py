"""Every user mistake and broken input is one line on stderr and exit status 2, whatever command and
whatever task meets it; what the engine changes of what was asked is said aloud.

The cases run in this process through ``main()`` (fast); ``python tests/test_cli_mistakes.py [ROOT]``
runs each one as a subprocess, the way a user would, from the checkout at ROOT (default: this one, e.g.
an older commit's to compare), and prints the table of commands, exit statuses and first lines of stderr.
"""
from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from support import FIXTURES, fixture, main_in_process

MODEL = "fixtures/tiny_q8_0.gguf"
RUN = ("run", "--model", MODEL, "--max-tokens", "4")  # --model: the spelling older versions take too

# (case id, arguments, exit status, a phrase of the one stderr line). {tmp} is a folder of prepared files.
MISTAKES = [
    ("run max-tokens 0", (*RUN, "--max-tokens", "0"), 2, "max-tokens must be >= 1"),
    ("run max-tokens -1", (*RUN, "--max-tokens", "-1"), 2, "max-tokens must be >= 1"),
    ("run temperature -1", (*RUN, "--temperature", "-1"), 2, "temperature must be >= 0"),
    ("run temperature nan", (*RUN, "--temperature", "nan"), 2, "temperature must be >= 0"),
    ("run top-p 2", (*RUN, "--top-p", "2"), 2, "top-p must be in (0, 1]"),
    ("run top-k -3", (*RUN, "--top-k", "-3"), 2, "top-k must be >= 0"),
    ("run min-p 5", (*RUN, "--min-p", "5"), 2, "min-p must be in [0, 1]"),
    ("run seed -1", (*RUN, "--seed", "-1"), 2, "seed must be >= 0"),
    ("run empty prompt", (*RUN, "--prompt", ""), 2, "the prompt is empty"),
    ("run prompt longer than the context", (*RUN, "--prompt-file", "{tmp}/long.txt"), 2, "the context holds 256"),
    ("run ctx 1", (*RUN, "--ctx", "1"), 2, "the context holds 1"),
    ("run ctx 0", (*RUN, "--ctx", "0"), 2, "--ctx must be >= 1"),
    ("run ctx -5", (*RUN, "--ctx", "-5"), 2, "--ctx must be >= 1"),
    ("run prompt not UTF-8 (argv)", (*RUN, "--prompt", "caf\udce9"), 2, "not UTF-8"),
    ("run prompt-file not UTF-8", (*RUN, "--prompt-file", "{tmp}/latin1.txt"), 2, "not UTF-8"),
    ("run prompt-file missing", (*RUN, "--prompt-file", "{tmp}/nope.txt"), 2, "cannot read"),
    ("run ram-budget 10T", (*RUN, "--ram-budget", "10T"), 2, "is more than"),
    ("run ram-budget nonsense", (*RUN, "--ram-budget", "lots"), 2, "not a size"),
    ("run two different models", ("run", "fixtures/tiny_f32.gguf", "--model", MODEL), 2, "two models given"),
    ("run stats-json in a missing folder", (*RUN, "--stats-json", "{tmp}/no/dir/s.jsonl"), 2, "no such folder"),
    ("run max-tokens not a number", (*RUN, "--max-tokens", "abc"), 2, "invalid int value"),
    ("run missing model", ("run", "{tmp}/nope.gguf"), 2, "no such model file"),
    ("run pin FILE missing", (*RUN, "--pin", "{tmp}/nope.json"), 2, "no such usage history"),
    ("run pin auto without history", (*RUN, "--pin", "auto", "--no-history"), 2, "--no-history"),
    ("logits out in a missing folder", ("logits", MODEL, "--ids", "1,2", "--out", "{tmp}/no/dir/l.npy"), 2,
     "no such folder"),
    ("trace out in a missing folder", ("trace", MODEL, "--prompt", "a", "--out", "{tmp}/no/dir/t.jsonl"), 2,
     "no such folder"),
    ("trace-stats empty trace", ("trace-stats", "{tmp}/empty.jsonl"), 2, "empty"),
    ("trace-stats garbage trace", ("trace-stats", "{tmp}/garbage.jsonl"), 2, "not"),
    ("trace-stats truncated trace", ("trace-stats", "{tmp}/truncated.jsonl"), 2, "not JSON"),
    ("trace-stats header only", ("trace-stats", "{tmp}/header.jsonl"), 2, "no route records"),
    ("trace-stats missing trace", ("trace-stats", "{tmp}/nope.jsonl"), 2, "cannot read"),
    ("replay empty trace", ("replay", "{tmp}/empty.jsonl"), 2, "empty"),
    ("replay garbage trace", ("replay", "{tmp}/garbage.jsonl"), 2, "not"),
    ("replay truncated trace", ("replay", "{tmp}/truncated.jsonl"), 2, "not JSON"),
    ("plan context -5", ("plan", MODEL, "--context", "-5"), 2, "--ctx must be >= 1"),
    ("plan pin FILE missing", ("plan", MODEL, "--pin", "{tmp}/nope.json"), 2, "no such usage history"),
    ("plan ram-budget 10T", ("plan", MODEL, "--ram-budget", "10T"), 2, "is more than"),
    ("plan cache-per-layer 0", ("plan", MODEL, "--cache-per-layer", "0"), 2, "--cache-per-layer must be >= 1"),
    ("doctor missing model", ("doctor", "{tmp}/nope.gguf"), 2, "no such model file"),
    ("run NaN in experts' scales", ("run", "{tmp}/nan_experts.gguf", "--max-tokens", "8"), 2,
     "layer 1 expert"),
    ("run NaN in output_norm", ("run", "{tmp}/nan_output_norm.gguf", "--max-tokens", "8"), 2, "output head"),
    ("doctor --verify NaN in one expert", ("doctor", "{tmp}/nan_expert3.gguf", "--verify"), 2, "expert 3"),
]
# What runs but differs from what was asked: said in one warning or in the summary, exit 0.
SAID_ALOUD = [
    ("run ctx 512 (model: 256)", (*RUN, "--ctx", "512"), 0, "--ctx 512 is more than the model's context_length 256"),
    ("run ctx 100000", (*RUN, "--ctx", "100000"), 0, "--ctx 100000 is more than"),
    ("run max-tokens 2000", (*RUN, "--max-tokens", "2000"), 0, "the context is full: 256 positions"),
    ("plan ctx 512", ("plan", MODEL, "--ctx", "512"), 0, "--ctx 512 is more than"),
]


def _tensor(path: Path, name: str):
    from colibri_aio.gguf.header import GGUFHeader

    return next(t for t in GGUFHeader(path).tensors if t.name == name)


def _poke(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


NAN_F16, NAN_F32 = struct.pack("<H", 0x7E00), struct.pack("<f", float("nan"))


def broken_models(tmp: Path) -> None:
    """Copies of the Q8_0 fixture with a NaN planted: in the first scale of every (or one) expert's
    down projection in layer 1, and in output_norm."""
    src = fixture("tiny_q8_0.gguf")
    for name in ("nan_experts", "nan_expert3", "nan_output_norm"):
        shutil.copyfile(src, tmp / f"{name}.gguf")
    down = _tensor(src, "blk.1.ffn_down_exps.weight")
    per_expert = down.n_bytes // int(down.shape[2])
    for e in range(int(down.shape[2])):
        _poke(tmp / "nan_experts.gguf", down.data_offset + e * per_expert, NAN_F16)
    _poke(tmp / "nan_expert3.gguf", down.data_offset + 3 * per_expert + 34 * 5, NAN_F16)  # block 5 of expert 3
    _poke(tmp / "nan_output_norm.gguf", _tensor(src, "output_norm.weight").data_offset + 4 * 7, NAN_F32)


def prepare(tmp: Path) -> Path:
    """The files the cases name: prompts, damaged traces, broken models."""
    (tmp / "long.txt").write_text("the list type " * 200)
    (tmp / "latin1.txt").write_bytes("café".encode("latin-1"))
    (tmp / "empty.jsonl").write_bytes(b"")
    (tmp / "garbage.jsonl").write_bytes(bytes(range(256)) * 8)
    header = {"kind": "header", "format": "colibri-aio-route-trace", "version": 1, "model": "m", "block_count": 2,
              "expert_count": 8, "expert_used_count": 2, "expert_nbytes": 6528, "predictors": []}
    route = {"kind": "route", "run": 0, "phase": "prefill", "pos": 0, "token": 1, "layer": 0, "experts": [1, 2],
             "weights": [0.5, 0.5]}
    whole = json.dumps(header) + "\n" + json.dumps(route) + "\n" + json.dumps({**route, "layer": 1}) + "\n"
    (tmp / "header.jsonl").write_text(json.dumps(header) + "\n")
    (tmp / "truncated.jsonl").write_text(whole[: len(whole) - 20])
    broken_models(tmp)
    return tmp


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare(tmp_path_factory.mktemp("mistakes"))


def _args(args: tuple[str, ...], tmp: Path) -> list[str]:
    return [a.format(tmp=tmp) for a in args]


@pytest.fixture(autouse=True)
def _at_the_repository_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(FIXTURES.parent)


@pytest.mark.parametrize("args,status,phrase", [c[1:] for c in MISTAKES], ids=[c[0] for c in MISTAKES])
def test_a_mistake_is_one_line_and_status_2(args: tuple[str, ...], status: int, phrase: str, files: Path) -> None:
    code, out, err = main_in_process(*_args(args, files))
    lines = err.strip().splitlines()
    assert code == status, err
    assert len(lines) == 1 or (len(lines) == 2 and lines[0].startswith("[")), err  # the start line of `run`
    assert lines[-1].startswith("colibri-aio: error: ") and phrase in lines[-1], err
    assert "Traceback" not in err


@pytest.mark.parametrize("args,status,phrase", [c[1:] for c in SAID_ALOUD], ids=[c[0] for c in SAID_ALOUD])
def test_what_differs_from_what_was_asked_is_said(args: tuple[str, ...], status: int, phrase: str,
                                                  files: Path) -> None:
    code, out, err = main_in_process(*_args(args, files))
    assert code == status, err
    assert phrase in err or phrase in out


def test_plan_notes_a_clamped_context() -> None:
    code, out, _ = main_in_process("plan", MODEL, "--ctx", "512", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["context"] == 256 and any("--ctx 512" in n for n in doc["notes"])


def test_flags_mean_the_same_in_every_command(files: Path) -> None:
    """Both spellings of the model and of the context work in run, logits, trace and plan."""
    a = main_in_process("run", "--model", MODEL, "--ctx", "64", "--max-tokens", "3")
    b = main_in_process("run", MODEL, "--context", "64", "--max-tokens", "3")
    assert a[0] == b[0] == 0 and a[1] == b[1]
    assert "f16 for 64 ctx" in a[2] and "f16 for 64 ctx" in b[2]
    for cmd in ("logits", "trace", "plan"):
        extra = {"logits": ("--ids", "1,2", "--out", str(files / "l.npy")),
                 "trace": ("--prompt", "a", "--max-tokens", "1", "--out", str(files / "t.jsonl")),
                 "plan": ()}[cmd]
        assert main_in_process(cmd, "--model", MODEL, "--ctx", "64", *extra)[0] == 0
        assert main_in_process(cmd, MODEL, "--context", "64", *extra)[0] == 0


def test_run_prompt_file_reads_long_prompts(files: Path) -> None:
    """A prompt too long for the argument list goes through a file (or standard input)."""
    (files / "prompt.txt").write_text("The list type")
    by_file = main_in_process("run", MODEL, "--prompt-file", str(files / "prompt.txt"), "--max-tokens", "5")
    by_arg = main_in_process("run", MODEL, "--prompt", "The list type", "--max-tokens", "5")
    assert by_file[0] == 0 and by_file[1] == by_arg[1]


def _table(root: Path) -> str:
    """Every case as a subprocess, as a user runs it from ``root``: a markdown table."""
    import tempfile

    rows = ["| case | command | exit | first line of stderr |", "|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        prepare(Path(tmp))
        for name, args, _, phrase in MISTAKES + SAID_ALOUD:
            argv = _args(args, Path(tmp))
            r = subprocess.run([sys.executable, "-m", "colibri_aio", *argv], capture_output=True,
                               cwd=root, env={"XDG_CACHE_HOME": tmp, "PATH": "/usr/bin:/bin"})
            err = r.stderr.decode("utf-8", "replace").strip().splitlines()
            first = next((line for line in err if not line.startswith("[")), err[0] if err else "")
            if first.startswith("Traceback"):
                first = f"{err[-1]} (a traceback of {len(err)} lines)"
            elif r.returncode == 0:  # what was said about the change, on stderr (or in plan's table)
                said = [line for line in err + r.stdout.decode().splitlines() if phrase and phrase in line]
                first = said[0] if said else first
            shown = " ".join(a.replace(tmp, "$TMP").encode("utf-8", "surrogateescape").decode("latin-1")
                             if "\udce9" in a else a.replace(tmp, "$TMP") for a in argv)
            rows.append(f"| {name} | `{shown}` | {r.returncode} | {first.replace('|', '/')[:160]} |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    print(_table(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else FIXTURES.parent))
