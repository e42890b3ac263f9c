"""Export a trained qwen3moe checkpoint (Hugging Face layout) to GGUF, F32 or Q8_0.

Needs only numpy, gguf and safetensors (no torch). Experts are stacked with
the expert axis outermost, so one expert's rows of each of gate/up/down form
one contiguous byte range in the file — the unit the engine streams.

    python tools/export_gguf.py /work/artifacts/tiny_moe fixtures/trained_f32.gguf --type f32
    python tools/export_gguf.py /work/artifacts/tiny_moe colibri_aio/models/colibri-tiny-q8_0.gguf --type q8_0
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "fixtures"))
from gguf_tokenizer import add_tokenizer  # noqa: E402  (fixtures/ is a script folder)

ARCH = "qwen3moe"
NAME = "colibri-tiny"
DESCRIPTION = (
    "colibri-tiny: a small qwen3moe mixture-of-experts model trained by colibri-aio's "
    "tools/train_tiny_moe.py on the Python 3.11 documentation sources (reStructuredText, "
    "Debian package python3.11-doc), which are under the PSF License Version 2 "
    "(Copyright Python Software Foundation). Weights: Apache-2.0."
)
# Norms and routers stay F32 in every export: they are tiny, and a quantised
# router would change which experts are chosen.
KEEP_F32 = ("_norm", "ffn_gate_inp")


@dataclass(frozen=True)
class Hparams:
    """The qwen3moe hyper-parameters that go into GGUF keys, read from config.json."""

    vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff: int
    n_ctx: int
    rope_theta: float
    rms_eps: float
    tied: bool

    @classmethod
    def from_config(cls, cfg: dict) -> "Hparams":
        if not cfg.get("norm_topk_prob", False):
            # llama.cpp always renormalises qwen3moe's top-k weights; a model
            # trained without it would run differently there.
            raise SystemExit("config has norm_topk_prob=false; qwen3moe GGUF readers renormalise top-k")
        rope = cfg.get("rope_parameters") or {}
        return cls(
            vocab=cfg["vocab_size"], n_embd=cfg["hidden_size"], n_layer=cfg["num_hidden_layers"],
            n_head=cfg["num_attention_heads"], n_head_kv=cfg["num_key_value_heads"],
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            n_expert=cfg.get("num_experts") or cfg["num_local_experts"],
            n_expert_used=cfg["num_experts_per_tok"], n_ff_exp=cfg["moe_intermediate_size"],
            n_ff=cfg["intermediate_size"], n_ctx=cfg["max_position_embeddings"],
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            rms_eps=float(cfg["rms_norm_eps"]), tied=bool(cfg.get("tie_word_embeddings", False)),
        )


def write_hparams(w: gguf.GGUFWriter, hp: Hparams) -> None:
    """Every qwen3moe key a reader needs; rope.freq_base is explicit (readers default to 1e4)."""
    w.add_context_length(hp.n_ctx)
    w.add_embedding_length(hp.n_embd)
    w.add_block_count(hp.n_layer)
    w.add_feed_forward_length(hp.n_ff)
    w.add_expert_feed_forward_length(hp.n_ff_exp)
    w.add_head_count(hp.n_head)
    w.add_head_count_kv(hp.n_head_kv)
    w.add_key_length(hp.head_dim)
    w.add_value_length(hp.head_dim)
    w.add_rope_freq_base(hp.rope_theta)
    w.add_layer_norm_rms_eps(hp.rms_eps)
    w.add_expert_count(hp.n_expert)
    w.add_expert_used_count(hp.n_expert_used)


def stack_experts(sd: dict[str, np.ndarray], layer: int, proj: str, n_expert: int) -> np.ndarray:
    """One (n_expert, rows, cols) array from the per-expert matrices, expert axis outermost.

    Accepts both checkpoint layouts: per-expert ``experts.E.{gate,up,down}_proj``
    and the fused ``experts.gate_up_proj`` (n_expert, 2*n_ff_exp, n_embd; gate
    rows first) / ``experts.down_proj`` (n_expert, n_embd, n_ff_exp).
    """
    prefix = f"model.layers.{layer}.mlp.experts"
    if f"{prefix}.0.{proj}.weight" in sd:
        return np.stack([sd[f"{prefix}.{e}.{proj}.weight"] for e in range(n_expert)])
    if proj == "down_proj":
        return sd[f"{prefix}.down_proj"]
    gate, up = np.split(sd[f"{prefix}.gate_up_proj"], 2, axis=1)
    return gate if proj == "gate_proj" else up


def gguf_tensors(sd: dict[str, np.ndarray], hp: Hparams) -> dict[str, np.ndarray]:
    """GGUF tensor name -> F32 array in NumPy order (ggml order reversed)."""
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    if not hp.tied:
        out["output.weight"] = sd["lm_head.weight"]
    names = {
        "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
        "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.gate",
    }
    for i in range(hp.n_layer):
        for dst, src in names.items():
            out[f"blk.{i}.{dst}.weight"] = sd[f"model.layers.{i}.{src}.weight"]
        # (n_expert, n_ff_exp, n_embd) for gate/up, (n_expert, n_embd, n_ff_exp) for down.
        for dst, proj in (("ffn_gate_exps", "gate_proj"), ("ffn_up_exps", "up_proj"), ("ffn_down_exps", "down_proj")):
            out[f"blk.{i}.{dst}.weight"] = stack_experts(sd, i, proj, hp.n_expert)
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def check_shapes(t: dict[str, np.ndarray], hp: Hparams) -> None:
    """Refuse to write a file whose shapes disagree with its own keys."""
    want = {"blk.0.attn_q.weight": (hp.n_head * hp.head_dim, hp.n_embd),
            "blk.0.attn_k.weight": (hp.n_head_kv * hp.head_dim, hp.n_embd),
            "blk.0.ffn_gate_inp.weight": (hp.n_expert, hp.n_embd),
            "blk.0.ffn_gate_exps.weight": (hp.n_expert, hp.n_ff_exp, hp.n_embd),
            "blk.0.ffn_up_exps.weight": (hp.n_expert, hp.n_ff_exp, hp.n_embd),
            "blk.0.ffn_down_exps.weight": (hp.n_expert, hp.n_embd, hp.n_ff_exp),
            "token_embd.weight": (hp.vocab, hp.n_embd)}
    for name, shape in want.items():
        if t[name].shape != shape:
            raise SystemExit(f"{name}: shape {t[name].shape}, expected {shape}")


def encode(name: str, arr: np.ndarray, qtype: gguf.GGMLQuantizationType) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """The bytes to store for one tensor and their type; 1-D tensors and routers stay F32."""
    if qtype == gguf.GGMLQuantizationType.F32 or arr.ndim < 2 or any(k in name for k in KEEP_F32):
        return arr, gguf.GGMLQuantizationType.F32
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if arr.shape[-1] % block:
        raise SystemExit(f"{name}: row length {arr.shape[-1]} is not a multiple of {block}")
    return gguf.quants.quantize(arr, qtype), qtype


def export(checkpoint: Path, out: Path, type_name: str) -> Path:
    """Write one GGUF from a checkpoint folder (config.json + model.safetensors)."""
    qtype = {"f32": gguf.GGMLQuantizationType.F32, "q8_0": gguf.GGMLQuantizationType.Q8_0}[type_name]
    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[type_name]
    hp = Hparams.from_config(json.loads((checkpoint / "config.json").read_text()))
    tensors = gguf_tensors(load_file(str(checkpoint / "model.safetensors")), hp)
    check_shapes(tensors, hp)

    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(out), ARCH)
    w.add_name(NAME)
    w.add_license("Apache-2.0")
    w.add_description(DESCRIPTION)
    w.add_file_type(ftype)
    if qtype != gguf.GGMLQuantizationType.F32:
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    write_hparams(w, hp)
    if add_tokenizer(w) != hp.vocab:
        raise SystemExit(f"tokenizer size differs from the model's vocab ({hp.vocab})")
    for name, arr in tensors.items():
        data, dtype = encode(name, arr, qtype)
        w.add_tensor(name, data, raw_dtype=dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path, help="folder with config.json and model.safetensors")
    p.add_argument("out", type=Path, help="GGUF file to write")
    p.add_argument("--type", choices=("f32", "q8_0"), default="q8_0")
    a = p.parse_args()
    path = export(a.checkpoint, a.out, a.type)
    print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
