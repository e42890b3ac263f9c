"""A GGUF of a real model's shape whose tensor data is a hole: the header is real, the file is sparse.

``plan`` (and anything that reads only the header and the tensor table) sees
the real model, Qwen3-30B-A3B in Q8_0 here, at the cost of a few kB of disk.
"""
from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

# Qwen3-30B-A3B: vocab, embedding, heads, KV heads, head dim, experts, used, expert FFN, context.
QWEN3_30B_A3B = dict(vocab=151936, d=2048, heads=32, kv_heads=4, head_dim=128, experts=128, used=8, ff=768,
                     context=40960)


def _q8_nbytes(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape)) // 32 * 34


def write_sparse_qwen3moe(path: Path, layers: int = 48, **shape: int) -> Path:
    """Write a qwen3moe header of ``layers`` blocks (Q8_0 matrices, F32 vectors) and extend the file to full size."""
    s = {**QWEN3_30B_A3B, **shape}
    d, hd, e, ff = s["d"], s["head_dim"], s["experts"], s["ff"]
    w = gguf.GGUFWriter(str(path), arch="qwen3moe")
    w.add_context_length(s["context"])
    w.add_embedding_length(d)
    w.add_block_count(layers)
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(e)
    w.add_expert_used_count(s["used"])
    w.add_expert_feed_forward_length(ff)
    tensors: list[tuple[str, tuple[int, ...], T]] = [
        ("token_embd.weight", (s["vocab"], d), T.Q8_0), ("output_norm.weight", (d,), T.F32),
        ("output.weight", (s["vocab"], d), T.Q8_0)]
    for i in range(layers):
        p = f"blk.{i}."
        tensors += [(p + "attn_norm.weight", (d,), T.F32), (p + "attn_q.weight", (s["heads"] * hd, d), T.Q8_0),
                    (p + "attn_k.weight", (s["kv_heads"] * hd, d), T.Q8_0),
                    (p + "attn_v.weight", (s["kv_heads"] * hd, d), T.Q8_0),
                    (p + "attn_q_norm.weight", (hd,), T.F32), (p + "attn_k_norm.weight", (hd,), T.F32),
                    (p + "attn_output.weight", (d, s["heads"] * hd), T.Q8_0), (p + "ffn_norm.weight", (d,), T.F32),
                    (p + "ffn_gate_inp.weight", (e, d), T.F32), (p + "ffn_gate_exps.weight", (e, ff, d), T.Q8_0),
                    (p + "ffn_up_exps.weight", (e, ff, d), T.Q8_0), (p + "ffn_down_exps.weight", (e, d, ff), T.Q8_0)]
    data = 0
    for name, shp, kind in tensors:
        nbytes = int(np.prod(shp)) * 4 if kind == T.F32 else _q8_nbytes(shp)
        w.add_tensor_info(name, shp, np.dtype(np.float32), nbytes, raw_dtype=None if kind == T.F32 else kind)
        data += -(-nbytes // 32) * 32
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    header = path.stat().st_size
    os.truncate(path, -(-header // 32) * 32 + data)  # a hole: no data blocks on disk
    return path
