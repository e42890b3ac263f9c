"""The tensor plan of a synthetic MoE model (any family of shapes.py) and the bytes of each tensor, chunk by chunk.

Shape legend (NumPy order, as QTensor and our loader use it): D embedding_length,
F expert_feed_forward_length, E expert_count, H*d query width, Hkv*d key/value
width, V vocab_size. Expert tensors are stacked expert-axis outermost.

Every tensor draws from its own generator, seeded by (seed, tensor name), so a
cut to N layers holds exactly the first N layers of the full model and the
bytes do not depend on the chunk size.
"""
from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
from gguf import GGMLQuantizationType as T

from synthetic.blocks import ENCODERS
from synthetic.shapes import Shape

# The residual-stream channels 0..CODE_CHANNELS-1 carry a constant "code" (the same
# sign pattern for every token) that nothing but the token embedding writes (rows
# 0..CODE_CHANNELS-1 of attn_output and of every expert's ffn_down are zero) and
# nothing but the routers reads (columns 0..CODE_CHANNELS-1 of attn_q/k/v,
# ffn_gate/up_exps and output are zero). A router column block aligned with the
# code then acts as a per-expert bias (see routing.py) and nothing else: read by
# attention or the experts, it would add the same vector to every position at
# every layer.
# 32 channels = one Q8_0 block = one Q4_K sub-block = two Q6_K scale groups.
CODE_CHANNELS = 32


@dataclass(frozen=True)
class Scales:
    """Standard deviations of the dequantised weights.

    Matrices reading a normalised hidden state use 1/sqrt(fan_in) (0.022 for
    D=2048, like trained Qwen3 layers); the writers back into the residual are
    smaller, so that 48 layers grow its RMS only ~3x. Embedding rows are
    deliberately large (std 1, trained models: ~0.02): random attention does not
    carry a token's identity forward as trained attention does, and with small
    embeddings every position would route alike after the first layer.
    """

    embedding: float = 1.0
    attn_in: float = 1.0        # x 1/sqrt(D): attn_q, attn_k, attn_v
    attn_out: float = 0.5       # x 1/sqrt(H*d): attn_output
    expert_in: float = 1.0      # x 1/sqrt(D): ffn_gate_exps, ffn_up_exps
    expert_out: float = 1.0     # x 1/sqrt(F): ffn_down_exps
    output: float = 1.0         # x 1/sqrt(D): logits of std ~1
    norm_noise: float = 0.1     # RMSNorm weights are 1 + this * N(0, 1)


@dataclass
class TensorPlan:
    """One tensor: name, NumPy-order shape, type, and how its values are drawn."""

    name: str
    shape: tuple[int, ...]
    qtype: T
    std: float = 0.0
    zero_rows: int = 0            # first rows of every matrix that are all zeros
    blind: bool = False           # columns 0..CODE_CHANNELS-1 are zeros (the code is not read)
    code: np.ndarray | None = None  # signs written into the first block of every row
    data: np.ndarray | None = field(default=None, repr=False)  # F32 tensors: the values

    @property
    def nbytes(self) -> int:
        if self.qtype == T.F32:
            return 4 * math.prod(self.shape)
        enc = ENCODERS[self.qtype]
        return math.prod(self.shape) // enc.block * enc.type_size


def tensor_rng(seed: int, name: str) -> np.random.Generator:
    """The generator of one tensor: independent of every other tensor and of the plan order."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, zlib.crc32(name.encode())])))


def norm_weight(seed: int, name: str, n: int, noise: float) -> np.ndarray:
    """RMSNorm weight ~1 with a little noise (an exact 1 would hide a misplaced norm)."""
    return (1.0 + noise * tensor_rng(seed, name).standard_normal(n)).astype(np.float32)


def code_signs(seed: int) -> np.ndarray:
    """The ±1 pattern of the code channels."""
    return np.where(tensor_rng(seed, "code").random(CODE_CHANNELS) < 0.5, -1.0, 1.0).astype(np.float32)


FALLBACK = {T.Q4_K: T.Q5_0}  # llama.cpp's quantiser: Q4_K rows of odd width become Q5_0, Q6_K ones Q8_0


def row_type(qtype: T, cols: int) -> T:
    """``qtype`` if rows of ``cols`` weights fill its blocks, else llama.cpp's fallback (32-weight blocks)."""
    return qtype if qtype == T.F32 or cols % ENCODERS[qtype].block == 0 else FALLBACK.get(qtype, T.Q8_0)


def _f32(seed: int, name: str, n: int, noise: float, zero_code: bool = False) -> TensorPlan:
    """A 1-D F32 tensor ~1 + noise (norms), optionally 0 on the code channels."""
    data = norm_weight(seed, name, n, noise)
    if zero_code:
        data[:CODE_CHANNELS] = 0
    return TensorPlan(name + ".weight", (n,), T.F32, data=data)


def _bias(seed: int, name: str, shape: tuple[int, ...], std: float, zero_code: bool = False) -> TensorPlan:
    """A bias: Gaussian of ``std`` (code channels of the residual left at 0 when it writes there)."""
    data = (std * tensor_rng(seed, name).standard_normal(shape)).astype(np.float32)
    if zero_code:
        data[..., :CODE_CHANNELS] = 0
    return TensorPlan(name, shape, T.F32, data=data)


def _matrix(name: str, shape: tuple[int, ...], qtype: T, std: float, reads_residual: bool = False,
            writes_residual: bool = False) -> TensorPlan:
    qtype = row_type(qtype, shape[-1])
    if reads_residual and ENCODERS[qtype].blind_columns >= shape[-1]:
        # a codebook type cannot zero the 32 code channels alone, only its whole first 256-weight block
        raise ValueError(f"{name}: {qtype.name} rows of {shape[-1]} weights would be all zeros once blind to "
                         f"the code channels; use a shape whose embedding is wider than "
                         f"{ENCODERS[qtype].blind_columns}")
    return TensorPlan(name, shape, qtype, std, blind=reads_residual, zero_rows=CODE_CHANNELS if writes_residual else 0)


def _attention(shape: Shape, p: str, matrix: T, seed: int, scales: Scales) -> list[TensorPlan]:
    """The attention tensors of one block (file order as llama.cpp's converters write them)."""
    d, hd, nz = shape.embedding_length, shape.head_dim, scales.norm_noise
    s_in = scales.attn_in / math.sqrt(d)
    if shape.mla:
        ql, kl, rope, nope, v, h = (shape.q_lora_rank, shape.kv_lora_rank, shape.qk_rope_dim, shape.qk_nope_dim,
                                    shape.v_head_dim, shape.head_count)
        return [
            _matrix(p + "attn_q_a.weight", (ql, d), matrix, s_in, reads_residual=True),
            _f32(seed, p + "attn_q_a_norm", ql, nz),
            _matrix(p + "attn_q_b.weight", (shape.q_width, ql), matrix, scales.attn_in / math.sqrt(ql)),
            _matrix(p + "attn_kv_a_mqa.weight", (kl + rope, d), matrix, s_in, reads_residual=True),
            _f32(seed, p + "attn_kv_a_norm", kl, nz),
            _matrix(p + "attn_k_b.weight", (h, kl, nope), matrix, scales.attn_in / math.sqrt(nope)),
            _matrix(p + "attn_v_b.weight", (h, v, kl), matrix, scales.attn_in / math.sqrt(kl)),
            _matrix(p + "attn_output.weight", (d, shape.o_width), matrix, scales.attn_out / math.sqrt(shape.o_width),
                    writes_residual=True),
        ]
    qw, kvw = shape.q_width, shape.kv_width
    gate = 2 if shape.full_attention_interval else 1   # qwen3next: each head's query and its output gate
    if shape.family == "bailingmoe2":   # one fused q/k/v matrix
        plans = [_matrix(p + "attn_qkv.weight", (qw + 2 * kvw, d), matrix, s_in, reads_residual=True)]
    else:
        plans = [
            _matrix(p + "attn_q.weight", (gate * qw, d), matrix, s_in, reads_residual=True),
            _matrix(p + "attn_k.weight", (kvw, d), matrix, s_in, reads_residual=True),
            _matrix(p + "attn_v.weight", (kvw, d), matrix, s_in, reads_residual=True),
        ]
    if shape.attn_bias:
        plans += [_bias(seed, p + f"attn_{x}.bias", (n,), 0.1) for x, n in (("q", qw), ("k", kvw), ("v", kvw))]
    if shape.qk_norm != "none":
        q_n, k_n = (hd, hd) if shape.qk_norm == "head" else (qw, kvw)
        plans += [_f32(seed, p + "attn_q_norm", q_n, nz), _f32(seed, p + "attn_k_norm", k_n, nz)]
    plans.append(_matrix(p + "attn_output.weight", (d, qw), matrix, scales.attn_out / math.sqrt(qw),
                         writes_residual=True))
    if shape.family == "gpt-oss":
        plans += [_bias(seed, p + "attn_output.bias", (d,), 0.1, zero_code=True),
                  TensorPlan(p + "attn_sinks.weight", (shape.head_count,), T.F32,
                             data=tensor_rng(seed, p + "attn_sinks").standard_normal(shape.head_count).astype(np.float32))]
    return plans


def _deltanet(shape: Shape, p: str, matrix: T, seed: int, scales: Scales) -> list[TensorPlan]:
    """A qwen3next recurrent block's linear attention (attn_qkv and attn_gate, as the current converter
    writes them): decays -A with A in U(1, 16), dt bias ~1, convolution taps of std 1/sqrt(K)."""
    d, dk, nv, k = shape.embedding_length, shape.linear_head_dim, shape.linear_value_heads, shape.conv_kernel
    s_in, c, inner = scales.attn_in / math.sqrt(d), shape.conv_channels, nv * shape.linear_head_dim
    rng = tensor_rng(seed, p + "ssm")
    return [
        _matrix(p + "attn_qkv.weight", (c, d), matrix, s_in, reads_residual=True),
        _matrix(p + "attn_gate.weight", (inner, d), matrix, s_in, reads_residual=True),
        TensorPlan(p + "ssm_conv1d.weight", (c, k), T.F32,
                   data=(rng.standard_normal((c, k)) / math.sqrt(k)).astype(np.float32)),
        TensorPlan(p + "ssm_dt.bias", (nv,), T.F32, data=norm_weight(seed, p + "ssm_dt", nv, scales.norm_noise)),
        TensorPlan(p + "ssm_a", (nv,), T.F32, data=(-rng.uniform(1.0, 16.0, nv)).astype(np.float32)),
        _matrix(p + "ssm_ba.weight", (2 * nv, d), matrix, s_in, reads_residual=True),
        _f32(seed, p + "ssm_norm", dk, scales.norm_noise),
        _matrix(p + "ssm_out.weight", (d, inner), matrix, scales.attn_out / math.sqrt(inner), writes_residual=True),
    ]


def _ffn_norm_name(shape: Shape) -> str:
    """glm4moe, gpt-oss and qwen3next name the FFN's input norm post_attention_norm."""
    return "post_attention_norm" if shape.family in ("glm4moe", "gpt-oss", "qwen3next") else "ffn_norm"


def _ffn(shape: Shape, i: int, p: str, matrix: T, expert: T, router: np.ndarray, seed: int,
         scales: Scales) -> list[TensorPlan]:
    """The FFN tensors of block ``i``: dense (leading blocks) or routed experts (+ shared expert, biases)."""
    d, f, e = shape.embedding_length, shape.expert_feed_forward_length, shape.expert_count
    s_in, nz = scales.expert_in / math.sqrt(d), scales.norm_noise
    plans = [_f32(seed, p + _ffn_norm_name(shape), d, nz)]
    if not shape.is_moe(i):
        ff = shape.dense_ff
        return plans + [
            _matrix(p + "ffn_gate.weight", (ff, d), matrix, s_in, reads_residual=True),
            _matrix(p + "ffn_up.weight", (ff, d), matrix, s_in, reads_residual=True),
            _matrix(p + "ffn_down.weight", (d, ff), matrix, scales.expert_out / math.sqrt(ff), writes_residual=True),
        ]
    plans.append(TensorPlan(p + "ffn_gate_inp.weight", (e, d), T.F32, data=router))
    if shape.family == "gpt-oss":
        plans.append(TensorPlan(p + "ffn_gate_inp.bias", (e,), T.F32, data=np.zeros(e, np.float32)))
    if shape.gating == "sigmoid":
        # zero correction bias: routing is shaped by the routers' code columns alone
        plans.append(TensorPlan(p + "exp_probs_b.bias", (e,), T.F32, data=np.zeros(e, np.float32)))
    plans += [
        _matrix(p + "ffn_gate_exps.weight", (e, f, d), expert, s_in, reads_residual=True),
        _matrix(p + "ffn_up_exps.weight", (e, f, d), expert, s_in, reads_residual=True),
        _matrix(p + "ffn_down_exps.weight", (e, d, f), expert, scales.expert_out / math.sqrt(f), writes_residual=True),
    ]
    if shape.family == "gpt-oss":
        plans += [_bias(seed, p + "ffn_gate_exps.bias", (e, f), 0.1), _bias(seed, p + "ffn_up_exps.bias", (e, f), 0.1),
                  _bias(seed, p + "ffn_down_exps.bias", (e, d), 0.1, zero_code=True)]
    fs = shape.shared_ff or shape.shared_count * f
    if fs:
        if shape.shared_ff and shape.family in ("qwen2moe", "qwen3next"):  # their sigmoid-gated shared expert
            plans.append(_bias(seed, p + "ffn_gate_inp_shexp.weight", (d,), 1 / math.sqrt(d), zero_code=True))
        plans += [
            _matrix(p + "ffn_gate_shexp.weight", (fs, d), matrix, s_in, reads_residual=True),
            _matrix(p + "ffn_up_shexp.weight", (fs, d), matrix, s_in, reads_residual=True),
            _matrix(p + "ffn_down_shexp.weight", (d, fs), matrix, scales.expert_out / math.sqrt(fs),
                    writes_residual=True),
        ]
    return plans


def _nextn(shape: Shape, i: int, p: str, matrix: T, seed: int, scales: Scales) -> list[TensorPlan]:
    """glm4moe's NextN block extras (the block itself is an ordinary MoE block)."""
    d, nz = shape.embedding_length, scales.norm_noise
    return [
        _matrix(p + "nextn.eh_proj.weight", (d, 2 * d), matrix, 1 / math.sqrt(2 * d)),
        _f32(seed, p + "nextn.enorm", d, nz),
        _f32(seed, p + "nextn.hnorm", d, nz),
        _f32(seed, p + "nextn.shared_head_norm", d, nz),
    ]


def plan_tensors(shape: Shape, matrix: T, embd: T, output: T, routers: list[np.ndarray],
                 seed: int, scales: Scales = Scales(), expert: T | None = None) -> list[TensorPlan]:
    """Every tensor of the model in file order (llama.cpp's converters use the same order).

    ``routers`` holds one (E, D) matrix per block of ``shape.total_blocks`` (dense blocks ignore theirs);
    ``expert`` is the routed experts' type (default ``matrix``).
    """
    d, v, nz = shape.embedding_length, shape.vocab_size, scales.norm_noise
    expert = expert or matrix
    plans = [TensorPlan("token_embd.weight", (v, d), row_type(embd, d), scales.embedding, code=code_signs(seed))]
    for i in range(shape.total_blocks):
        p = f"blk.{i}."
        plans.append(_f32(seed, p + "attn_norm", d, nz))
        plans += (_deltanet if shape.is_recurrent(i) else _attention)(shape, p, matrix, seed, scales)
        plans += _ffn(shape, i, p, matrix, expert, routers[i], seed, scales)
        if i >= shape.block_count:
            plans += _nextn(shape, i, p, matrix, seed, scales)
    plans += [
        _f32(seed, "output_norm", d, nz),
        TensorPlan("output.weight", (v, d), row_type(output, d), scales.output / math.sqrt(d), blind=True),
    ]
    return plans


def _random_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    """n random bytes; 64-bit draws are ~8x faster than Generator.bytes."""
    words = rng.integers(0, 1 << 64, size=-(-n // 8), dtype=np.uint64)
    return words.view(np.uint8)[:n]


def tensor_chunks(plan: TensorPlan, seed: int, chunk_bytes: int) -> Iterator[np.ndarray]:
    """The tensor's bytes as flat uint8 arrays of whole rows, about ``chunk_bytes`` each."""
    if plan.qtype == T.F32:
        assert plan.data is not None and plan.data.shape == plan.shape, plan.name
        yield np.ascontiguousarray(plan.data, dtype="<f4").view(np.uint8).reshape(-1)
        return
    enc = ENCODERS[plan.qtype]
    rng = tensor_rng(seed, plan.name)
    lut = enc.make_lut(rng, plan.std)
    cols, rows_per_matrix = plan.shape[-1], plan.shape[-2]
    n_rows = math.prod(plan.shape[:-1])
    blocks_per_row = cols // enc.block
    row_bytes = blocks_per_row * enc.type_size
    step = max(1, chunk_bytes // row_bytes)
    for r0 in range(0, n_rows, step):
        r1 = min(n_rows, r0 + step)
        raw = _random_bytes(rng, (r1 - r0) * row_bytes)
        blocks = raw.reshape(-1, enc.type_size)
        enc.finish(blocks, lut)
        by_row = raw.reshape(r1 - r0, blocks_per_row, enc.type_size)
        if plan.zero_rows:
            zero = np.nonzero(np.arange(r0, r1) % rows_per_matrix < plan.zero_rows)[0]
            by_row[zero, :, enc.scale_bytes] = 0
        if plan.code is not None or plan.blind:
            first = by_row[:, 0, :].copy()
            if plan.code is not None:
                enc.apply_code(first, plan.code, lut)
            else:
                enc.zero_first_32(first)
            by_row[:, 0, :] = first
        yield raw
