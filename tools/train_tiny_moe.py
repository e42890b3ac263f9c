"""Train colibri-tiny: a small qwen3moe model on the Python documentation corpus.

Dev-only: needs CPU torch and transformers, which the engine never imports.
The run is seeded and stops after a fixed number of steps, so the same command
on the same software gives the same data order and schedule; weights agree up
to the order of CPU float reductions (~1e-6 in the loss). Wall time only
affects speed.

    python tools/train_tiny_moe.py --out /work/artifacts/tiny_moe          # full run
    python tools/train_tiny_moe.py --steps 20 --out /tmp/tiny_moe_probe    # speed probe

Writes into --out: the Hugging Face checkpoint (config.json + safetensors),
train_log.jsonl (one line per logged step) and metrics.json (held-out
perplexity beside the unigram baseline, wall time, tokens/s, host, commit).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# On a shared host, OpenMP threads that spin at every barrier stall whenever
# another process holds a core: measured 141 tokens/s spinning against 1200
# passive at load 9 on 2 cores. Must be set before torch starts OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "fixtures"))
import corpus  # noqa: E402  (fixtures/ is a script folder, not a package)
from colibri_aio.bench.receipt import git_state, host_facts  # noqa: E402

TOKENIZER = REPO / "fixtures" / "tokenizer.json"
EOT_ID = 0  # <|endoftext|>: documents are joined with it, as the GGUF's eos says


@dataclass(frozen=True)
class ModelShape:
    """The architecture; every axis a Q8_0 row runs along is a multiple of 32."""

    vocab: int = 2048
    hidden: int = 128
    layers: int = 6
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    experts: int = 32
    top_k: int = 4
    expert_ffn: int = 64
    context: int = 256


@dataclass(frozen=True)
class TrainPlan:
    """Optimisation settings: AdamW, linear warmup then cosine decay to lr_min."""

    seed: int = 0
    steps: int = 500
    batch: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    lr_min: float = 3e-4
    warmup: int = 50
    weight_decay: float = 0.1
    aux_loss_coef: float = 0.01
    grad_clip: float = 1.0
    log_every: int = 25
    eval_every: int = 100
    eval_windows: int = 48  # windows of seq_len held-out tokens for the periodic check


def make_config(shape: ModelShape, plan: TrainPlan) -> Qwen3MoeConfig:
    """A qwen3moe config whose routing matches llama.cpp's (top-k weights renormalised)."""
    for name in ("hidden", "expert_ffn", "head_dim"):
        if getattr(shape, name) % 32:
            raise SystemExit(f"{name}={getattr(shape, name)} is not a multiple of 32 (Q8_0 blocks)")
    return Qwen3MoeConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        # Every layer is sparse (decoder_sparse_step=1), so the dense FFN width
        # is unused; it is set to the expert width so the GGUF key is truthful.
        intermediate_size=shape.expert_ffn,
        moe_intermediate_size=shape.expert_ffn,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.context,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rms_norm_eps=1e-6,
        num_experts=shape.experts,
        num_experts_per_tok=shape.top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        output_router_logits=True,
        router_aux_loss_coef=plan.aux_loss_coef,
        tie_word_embeddings=False,
        bos_token_id=EOT_ID,
        eos_token_id=EOT_ID,
        pad_token_id=EOT_ID,
    )


def tokenize(split: str) -> np.ndarray:
    """All documents of a split as one id stream, each document followed by <|endoftext|>."""
    tok = Tokenizer.from_file(str(TOKENIZER))
    parts: list[int] = []
    for enc in tok.encode_batch(corpus.texts(split)):
        parts.extend(enc.ids)
        parts.append(EOT_ID)
    return np.asarray(parts, dtype=np.int64)


def unigram_perplexity(train: np.ndarray, heldout: np.ndarray, vocab: int) -> float:
    """Perplexity of add-one-smoothed train token frequencies on the held-out stream."""
    counts = np.bincount(train, minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(np.exp(-logp[heldout].mean()))


def sample_batch(ids: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """Random windows of seq_len + 1 tokens (inputs and their next-token labels)."""
    starts = torch.randint(0, len(ids) - seq_len - 1, (batch,), generator=gen)
    return torch.stack([ids[s : s + seq_len + 1] for s in starts.tolist()])


def learning_rate(step: int, plan: TrainPlan) -> float:
    """Linear warmup to plan.lr, then cosine down to plan.lr_min at the last step."""
    if step < plan.warmup:
        return plan.lr * (step + 1) / plan.warmup
    t = (step - plan.warmup) / max(1, plan.steps - plan.warmup)
    return plan.lr_min + 0.5 * (plan.lr - plan.lr_min) * (1.0 + math.cos(math.pi * t))


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices and expert stacks; leave norms (1-D) alone, as is usual."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    keep = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0}]


@torch.no_grad()
def heldout_perplexity(model: Qwen3MoeForCausalLM, ids: torch.Tensor, seq_len: int,
                       max_windows: int | None = None, batch: int = 16) -> tuple[float, int]:
    """Mean next-token perplexity over non-overlapping windows; returns (ppl, tokens scored)."""
    model.eval()
    n_windows = (len(ids) - 1) // seq_len
    if max_windows is not None:
        n_windows = min(n_windows, max_windows)
    nll, count = 0.0, 0
    for w0 in range(0, n_windows, batch):
        w1 = min(n_windows, w0 + batch)
        x = torch.stack([ids[w * seq_len : w * seq_len + seq_len + 1] for w in range(w0, w1)])
        logits = model(input_ids=x[:, :-1], output_router_logits=False, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
        nll += float(loss)
        count += x[:, 1:].numel()
    model.train()
    return math.exp(nll / count), count


def expert_use(model: Qwen3MoeForCausalLM, x: torch.Tensor, top_k: int) -> list[list[float]]:
    """Share of top-k selections each expert gets, per layer, on a batch of held-out text."""
    with torch.no_grad():
        out = model(input_ids=x, output_router_logits=True, use_cache=False)
    shares = []
    for logits in out.router_logits:
        picks = torch.topk(logits, top_k, dim=-1).indices.reshape(-1)
        counts = torch.bincount(picks, minlength=logits.shape[-1]).double()
        shares.append((counts / counts.sum()).tolist())
    return shares


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="checkpoint and log folder")
    p.add_argument("--threads", type=int, default=2)
    for f, v in asdict(TrainPlan()).items():
        p.add_argument(f"--{f.replace('_', '-')}", type=type(v), default=v)
    for f, v in asdict(ModelShape()).items():
        if f != "vocab":
            p.add_argument(f"--{f.replace('_', '-')}", type=type(v), default=v)
    return p.parse_args()


def train(args: argparse.Namespace) -> dict:
    """Run the whole job and return the metrics that go into the receipt."""
    plan = TrainPlan(**{f: getattr(args, f) for f in asdict(TrainPlan())})
    shape = ModelShape(**{f: getattr(args, f) for f in asdict(ModelShape()) if f != "vocab"})
    torch.set_num_threads(args.threads)
    torch.manual_seed(plan.seed)
    args.out.mkdir(parents=True, exist_ok=True)

    train_ids, held_ids = tokenize("train"), tokenize("heldout")
    uni_ppl = unigram_perplexity(train_ids, held_ids, shape.vocab)
    train_t, held_t = torch.from_numpy(train_ids), torch.from_numpy(held_ids)
    print(f"tokens: train {len(train_ids)}  held-out {len(held_ids)}  unigram ppl {uni_ppl:.2f}", flush=True)

    config = make_config(shape, plan)
    model = Qwen3MoeForCausalLM(config)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    n_expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    opt = torch.optim.AdamW(param_groups(model, plan.weight_decay), lr=plan.lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(plan.seed)

    log = (args.out / "train_log.jsonl").open("w")
    t0, seen = time.perf_counter(), 0
    train_seconds = 0.0
    for step in range(plan.steps):
        ts = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = learning_rate(step, plan)
        x = sample_batch(train_t, plan.batch, plan.seq_len, gen)
        out = model(input_ids=x[:, :-1], output_router_logits=True, use_cache=False)
        # The loss is formed here (not via labels=) so every one of the seq_len
        # positions is scored against x[:, 1:]; the router term is Qwen3-MoE's.
        lm_loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, shape.vocab), x[:, 1:].reshape(-1))
        loss = lm_loss + plan.aux_loss_coef * out.aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), plan.grad_clip))
        opt.step()
        train_seconds += time.perf_counter() - ts
        seen += plan.batch * plan.seq_len
        row = None
        if step % plan.log_every == 0 or step == plan.steps - 1:
            row = {"step": step, "lr": learning_rate(step, plan), "loss": float(lm_loss.detach()), "aux": float(out.aux_loss.detach()),
                   "grad_norm": gnorm, "tok_s": seen / train_seconds, "wall": time.perf_counter() - t0}
        if (step + 1) % plan.eval_every == 0 and step + 1 < plan.steps:
            row = row or {"step": step}
            row["heldout_ppl_subset"] = heldout_perplexity(model, held_t, plan.seq_len, plan.eval_windows)[0]
        if row:
            log.write(json.dumps(row) + "\n")
            log.flush()
            print(json.dumps(row), flush=True)
    log.close()

    wall_train = time.perf_counter() - t0
    ppl, scored = heldout_perplexity(model, held_t, plan.seq_len)
    shares = expert_use(model, held_t[: 8 * plan.seq_len].reshape(8, plan.seq_len), shape.top_k)
    model.config.output_router_logits = False
    model.save_pretrained(args.out)
    metrics = {
        "command": "python " + " ".join(sys.argv),
        "seed": plan.seed,
        "shape": asdict(shape),
        "plan": asdict(plan),
        "params_total": n_params,
        "params_experts": n_expert,
        "params_active_per_token": n_params - n_expert + n_expert * shape.top_k // shape.experts,
        "tokens_train": int(len(train_ids)),
        "tokens_heldout_scored": scored,
        "tokens_seen": seen,
        "epochs": seen / len(train_ids),
        "heldout_ppl": ppl,
        "unigram_ppl": uni_ppl,
        "final_train_loss": float(lm_loss.detach()),
        "final_aux_loss": float(out.aux_loss),
        "wall_train_s": wall_train,
        "tokens_per_s": seen / train_seconds,
        "expert_share_heldout": shares,
        "threads": args.threads,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "host": host_facts()["hostname"],
        "cpu": host_facts()["cpu"] or host_facts()["machine"],
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "commit": git_state()["sha"],
        "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    print(f"held-out ppl {ppl:.2f} (unigram {uni_ppl:.2f}); {seen / train_seconds:.0f} tok/s; "
          f"{wall_train:.0f} s", flush=True)
    return metrics


if __name__ == "__main__":
    train(parse_args())
