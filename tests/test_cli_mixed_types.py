"""An unsloth-style file (a type per tensor: experts at IQ1_S/IQ2_XXS, attention at Q4_K/Q6_K/Q8_0, written by
llama.cpp's quantiser: fixtures/quant_types/README.md) through ``run``, ``chat`` and ``serve`` as users run them;
and a type no kernel runs, refused at the command line in one line naming tensor and type."""
from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import openai

from colibri_aio.serve.launch import ServerProcess
from colibri_aio.text.tokenizer import Tokenizer
from support import FIXTURES, fixture, run_cli

MIXED = str(fixture("quant_types/ktiny_mixed_iq.gguf"))
GREEDY = ["--temperature", "0"]
STATUS = re.compile(r"\[(\d+) tokens, [\d.]+ tok/s; prompt (\d+) tokens, (\d+) from the KV cache")


def test_run_on_a_mixed_low_bit_file_greedy_picks_the_argmax_of_its_logits(tmp_path) -> None:
    r = run_cli("run", "--model", MIXED, "--prompt", "def f(x):", "--max-tokens", "1", *GREEDY)
    assert r.returncode == 0, r.stderr
    tok = Tokenizer.from_path(MIXED)
    ids = tok.encode("def f(x):")
    out = tmp_path / "l.npy"
    assert run_cli("logits", MIXED, "--ids", ",".join(map(str, ids)), "--out", str(out)).returncode == 0
    last = np.load(out)[-1]
    tied = np.flatnonzero(last >= last.max() - 1e-4 * np.abs(last).max())  # prefill kernels differ (matvec/matmul)
    assert r.stdout.rstrip("\n") in {tok.decode([int(t)], skip_special=True) for t in tied}
    r = run_cli("run", "--model", MIXED, "--prompt", "The list type", "--max-tokens", "12", *GREEDY,
                "--logit-bias", "0=-100", "--logit-bias", "2=-100")
    assert r.returncode == 0 and "decode 12 tok" in r.stderr, r.stderr


def test_chat_on_a_mixed_low_bit_file_keeps_its_history() -> None:
    r = subprocess.run([sys.executable, "-m", "colibri_aio", "chat", "--model", MIXED, "--max-tokens", "6",
                        "--io", "pread", *GREEDY], input="What is a list?\nAnd a tuple?\n", capture_output=True,
                       text=True, timeout=300, cwd=FIXTURES.parent)
    assert r.returncode == 0, r.stderr
    turns = [tuple(map(int, m)) for m in STATUS.findall(r.stderr)]
    assert len(turns) == 2, r.stderr
    (gen1, prompt1, cached1), (gen2, prompt2, cached2) = turns
    assert gen1 == gen2 == 6 and cached1 == 0
    # the second turn found the first in the KV cache (up to where the template re-renders the first reply:
    # this random model's replies are mostly whitespace, which the template trims)
    assert prompt1 // 2 < cached2 < prompt2


def test_serve_on_a_mixed_low_bit_file_answers_whole_and_streamed() -> None:
    with ServerProcess("--model", MIXED) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "What is a list?"}]
        whole = client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0)
        chunks = client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0,
                                                stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert whole.usage.completion_tokens >= 1
        assert streamed == whole.choices[0].message.content
    assert server.stop() in (0, 143)


def test_a_type_no_kernel_runs_is_refused_in_one_line_naming_tensor_and_type() -> None:
    r = run_cli("run", "--model", str(fixture("quant_types/f64_experts_bad.gguf")), "--prompt", "hi",
                "--max-tokens", "2")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "blk.0.ffn_down_exps.weight" in r.stderr and "F64" in r.stderr
