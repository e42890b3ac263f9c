"""Check the colibri-tiny exports against their checkpoint and write the training receipt.

Dev-only (torch, transformers, llama-cpp-python). Checks, on the F32 and the
Q8_0 GGUF:
  * llama.cpp loads the file, and its teacher-forced logits match the
    Hugging Face model's (F32 with an F32 KV cache: ~1e-5; Q8_0: ~1e-1,
    since llama.cpp also quantises activations);
  * llama.cpp tokenizes held-out text exactly as fixtures/tokenizer.json does;
  * held-out perplexity through llama.cpp on a slice of held-out windows;
  * sample continuations (greedy, and temperature 0.7 with seed 0).
Then writes evidence/train_tiny_moe.json and .md from these and the training
run's metrics.json.

    python tools/verify_tiny_moe.py --checkpoint /work/artifacts/tiny_moe \\
        --f32 /work/artifacts/tiny_moe/colibri-tiny-f32.gguf \\
        --q8 colibri_aio/models/colibri-tiny-q8_0.gguf
"""
from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from pathlib import Path

import numpy as np
import torch
from llama_cpp import Llama
from tokenizers import Tokenizer
from transformers import Qwen3MoeForCausalLM

from colibri_aio.bench.receipt import write

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
from train_tiny_moe import TOKENIZER, tokenize  # noqa: E402

GGML_TYPE_F32 = 0  # KV cache type: F32, so the F32 comparison is not limited by F16 rounding
PROMPT = "The list type"
SAMPLE_TOKENS = 80
SAMPLING = {"temperature": 0.7, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.0, "seed": 0}


def load_llama(path: Path, logits_all: bool) -> Llama:
    return Llama(model_path=str(path), n_ctx=256, n_batch=256, n_threads=2, n_threads_batch=2,
                 logits_all=logits_all, type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32, seed=0, verbose=False)


def llama_logits(llm: Llama, ids: list[int]) -> np.ndarray:
    """Teacher-forced logits at every position of ids, from a fresh KV cache."""
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float32)


@torch.no_grad()
def hf_logits(model: Qwen3MoeForCausalLM, ids: list[int]) -> np.ndarray:
    return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].numpy()


def perplexity(logits: np.ndarray, targets: np.ndarray) -> tuple[float, int]:
    """Summed negative log-likelihood (natural log) of targets, and the count."""
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return float(-logp[np.arange(len(targets)), targets].sum()), len(targets)


def compare(llm: Llama, model: Qwen3MoeForCausalLM, windows: list[list[int]]) -> dict:
    """Logit agreement and perplexity of llama.cpp against the checkpoint on the same windows."""
    worst, abs_sum, argmax_same, n_pos = 0.0, 0.0, 0, 0
    nll = {"llama_cpp": 0.0, "hf": 0.0}
    count = 0
    for w in windows:
        a, b = llama_logits(llm, w[:-1]), hf_logits(model, w[:-1])
        worst = max(worst, float(np.abs(a - b).max()))
        abs_sum += float(np.abs(a - b).mean()) * len(a)
        argmax_same += int((a.argmax(-1) == b.argmax(-1)).sum())
        n_pos += len(a)
        tgt = np.asarray(w[1:])
        nll["llama_cpp"] += perplexity(a, tgt)[0]
        nll["hf"] += perplexity(b, tgt)[0]
        count += len(tgt)
    return {"max_abs_logit_diff": worst, "mean_abs_logit_diff": abs_sum / n_pos, "argmax_agreement": argmax_same / n_pos, "positions": n_pos,
            "heldout_ppl_llama_cpp": math.exp(nll["llama_cpp"] / count),
            "heldout_ppl_hf_same_windows": math.exp(nll["hf"] / count)}


def tokenizer_identity(llm: Llama, docs: list[str]) -> dict:
    """Does llama.cpp split the held-out documents into the same ids as tokenizers does?"""
    tok = Tokenizer.from_file(str(TOKENIZER))
    same, n_tokens, first_bad = 0, 0, None
    for i, text in enumerate(docs):
        ours = tok.encode(text).ids
        theirs = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
        n_tokens += len(ours)
        if ours == theirs:
            same += 1
        elif first_bad is None:
            first_bad = i
    return {"documents": len(docs), "identical": same, "tokens": n_tokens, "first_mismatch_doc": first_bad}


def samples(llm: Llama) -> dict:
    """Greedy and sampled continuations of PROMPT."""
    greedy = llm.create_completion(PROMPT, max_tokens=SAMPLE_TOKENS, temperature=0.0, repeat_penalty=1.0)
    llm.reset()
    sampled = llm.create_completion(PROMPT, max_tokens=SAMPLE_TOKENS, **SAMPLING)
    return {"prompt": PROMPT, "max_tokens": SAMPLE_TOKENS, "greedy": greedy["choices"][0]["text"],
            "sampled": sampled["choices"][0]["text"], "sampling": SAMPLING}


def heldout_windows(n: int, seq_len: int = 129) -> list[list[int]]:
    """n evenly spaced windows of held-out ids (seq_len + 1 tokens each)."""
    ids = tokenize("heldout")
    starts = np.linspace(0, len(ids) - seq_len - 1, n).astype(int)
    return [ids[s : s + seq_len + 1].tolist() for s in starts]


def check_file(path: Path, model: Qwen3MoeForCausalLM, windows: list[list[int]], docs: list[str]) -> dict:
    llm = load_llama(path, logits_all=True)
    out = {"file": str(path), "bytes": path.stat().st_size, **compare(llm, model, windows),
           "tokenizer": tokenizer_identity(llm, docs)}
    llm.close()
    gen = load_llama(path, logits_all=False)
    out["samples"] = samples(gen)
    gen.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--f32", type=Path, required=True)
    p.add_argument("--q8", type=Path, required=True)
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--note", default="", help="free text for the receipt, e.g. the host's load during training")
    p.add_argument("--evidence", type=Path, default=REPO / "evidence" / "train_tiny_moe")
    a = p.parse_args()
    torch.set_num_threads(2)
    sys.path.insert(0, str(REPO / "fixtures"))
    import corpus

    model = Qwen3MoeForCausalLM.from_pretrained(a.checkpoint, dtype=torch.float32).eval()
    windows = heldout_windows(a.windows)
    docs = corpus.texts("heldout")
    checks = {"f32": check_file(a.f32, model, windows, docs), "q8_0": check_file(a.q8, model, windows, docs)}
    metrics = json.loads((a.checkpoint / "metrics.json").read_text())
    log = [json.loads(line) for line in (a.checkpoint / "train_log.jsonl").read_text().splitlines()]
    curve = [row for row in log if "heldout_ppl_subset" in row]
    receipt = {"training": metrics, "heldout_curve": curve, "exports": checks,
               "export_commands": [f"python tools/export_gguf.py {a.checkpoint} {a.f32} --type f32",
                                   f"python tools/export_gguf.py {a.checkpoint} {a.q8} --type q8_0"],
               "verify_command": "python " + shlex.join(sys.argv), "note": a.note}
    write(a.evidence.parent, a.evidence.stem, receipt, render_md(receipt))
    print(json.dumps({k: {x: v[x] for x in ("max_abs_logit_diff", "argmax_agreement", "heldout_ppl_llama_cpp")}
                      for k, v in checks.items()}, indent=1))


def render_md(r: dict) -> str:
    """The short human summary of the receipt."""
    t, f, q = r["training"], r["exports"]["f32"], r["exports"]["q8_0"]
    s = t["shape"]
    use = np.asarray(t["expert_share_heldout"])
    use_tokens = 8 * t["plan"]["seq_len"]  # train_tiny_moe.expert_use runs 8 held-out windows
    lines = [
        "# colibri-tiny: training receipt",
        "",
        f"A qwen3moe model: {s['layers']} layers, hidden {s['hidden']}, {s['heads']} heads "
        f"({s['kv_heads']} KV, head_dim {s['head_dim']}), {s['experts']} experts, top-{s['top_k']}, "
        f"expert FFN {s['expert_ffn']}, context {s['context']}, vocab {s['vocab']}; "
        f"{t['params_total'] / 1e6:.2f} M parameters ({t['params_active_per_token'] / 1e6:.2f} M active per token).",
        "Trained on the Python 3.11 documentation sources (Debian python3.11-doc, PSF License), "
        "tokenized with fixtures/tokenizer.json, documents joined with <|endoftext|>.",
        "",
        "| | value |",
        "|---|---|",
        f"| held-out perplexity (HF checkpoint, {t['tokens_heldout_scored']} tokens) | **{t['heldout_ppl']:.2f}** |",
        f"| unigram baseline (train frequencies, add-one) | {t['unigram_ppl']:.2f} |",
        f"| held-out ppl via llama.cpp, F32 GGUF ({f['positions']} positions) | {f['heldout_ppl_llama_cpp']:.2f} "
        f"(HF on the same windows {f['heldout_ppl_hf_same_windows']:.2f}) |",
        f"| held-out ppl via llama.cpp, Q8_0 GGUF (same windows) | {q['heldout_ppl_llama_cpp']:.2f} |",
        f"| final train loss (LM) / router aux loss | {t['final_train_loss']:.3f} / {t['final_aux_loss']:.3f} |",
        f"| steps x batch x seq_len | {t['plan']['steps']} x {t['plan']['batch']} x {t['plan']['seq_len']} "
        f"= {t['tokens_seen'] / 1e6:.2f} M tokens ({t['epochs']:.2f} epochs of {t['tokens_train'] / 1e6:.2f} M) |",
        f"| wall time (training loop) | {t['wall_train_s'] / 60:.1f} min |",
        f"| throughput | {t['tokens_per_s']:.0f} tokens/s, {t['threads']} threads "
        f"(OMP_WAIT_POLICY {t.get('omp_wait_policy')}) |",
        f"| expert use on {use_tokens} held-out tokens, per layer: largest share of top-k picks | "
        f"{use.max(1).round(3).tolist()} (uniform = {1 / s['experts']:.4f}) |",
        f"| experts never picked on those tokens, per layer | {(use == 0).sum(1).tolist()} of {s['experts']} |",
        "",
        "Held-out perplexity during training (first "
        f"{t['plan']['eval_windows']} held-out windows only; the table above scores all of them):",
        "",
        "| after step | held-out ppl (subset) |",
        "|---|---|",
        *[f"| {c['step'] + 1} | {c['heldout_ppl_subset']:.2f} |"
          for c in r["heldout_curve"]],
        "",
        *([r["note"], ""] if r.get("note") else []),
        "## Exports",
        "",
        "| file | bytes | max / mean abs logit diff vs HF | argmax agreement | tokenizer identical |",
        "|---|---|---|---|---|",
    ]
    for name, c in (("F32", f), ("Q8_0", q)):
        tk = c["tokenizer"]
        lines.append(f"| {name} `{c['file']}` | {c['bytes']} | {c['max_abs_logit_diff']:.2e} / {c['mean_abs_logit_diff']:.2e} | "
                     f"{c['argmax_agreement']:.4f} | {tk['identical']}/{tk['documents']} held-out docs "
                     f"({tk['tokens']} tokens) |")
    lines += ["", "The Q8_0 difference is expected: llama.cpp quantises activations to Q8_0 as well.", "",
              "## Samples (llama.cpp, Q8_0)", ""]
    smp = q["samples"]
    lines += [f"Prompt: `{smp['prompt']}`, {smp['max_tokens']} tokens.", "",
              "Greedy:", "", "```", smp["prompt"] + smp["greedy"], "```", "",
              f"Sampled ({', '.join(f'{k} {v}' for k, v in smp['sampling'].items())}):", "",
              "```", smp["prompt"] + smp["sampled"], "```", "",
              "## Reproduce", "", "```",
              t["command"], *r["export_commands"], r["verify_command"], "```", "",
              f"Host {t['host']} ({t['cpu']}), torch {t['torch']}, transformers {t['transformers']}, "
              f"commit {t['commit']}, seed {t['seed']}, finished {t['finished_utc']}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
