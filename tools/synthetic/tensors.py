"""The tensor plan of a synthetic qwen3moe model and the bytes of each tensor, chunk by chunk.

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


def plan_tensors(shape: Shape, matrix: T, embd: T, output: T, routers: list[np.ndarray],
                 seed: int, scales: Scales = Scales()) -> list[TensorPlan]:
    """Every tensor of the model in file order (llama.cpp's converters use the same order)."""
    d, f, e, v = shape.embedding_length, shape.expert_feed_forward_length, shape.expert_count, shape.vocab_size
    qw, kvw, hd = shape.q_width, shape.kv_width, shape.head_dim
    nz = scales.norm_noise
    code = code_signs(seed)
    plans = [TensorPlan("token_embd.weight", (v, d), embd, scales.embedding, code=code)]
    for i in range(shape.block_count):
        p = f"blk.{i}."
        plans += [
            TensorPlan(p + "attn_norm.weight", (d,), T.F32, data=norm_weight(seed, p + "attn_norm", d, nz)),
            TensorPlan(p + "attn_q.weight", (qw, d), matrix, scales.attn_in / math.sqrt(d),
                       blind=True),
            TensorPlan(p + "attn_k.weight", (kvw, d), matrix, scales.attn_in / math.sqrt(d),
                       blind=True),
            TensorPlan(p + "attn_v.weight", (kvw, d), matrix, scales.attn_in / math.sqrt(d),
                       blind=True),
            TensorPlan(p + "attn_q_norm.weight", (hd,), T.F32, data=norm_weight(seed, p + "attn_q_norm", hd, nz)),
            TensorPlan(p + "attn_k_norm.weight", (hd,), T.F32, data=norm_weight(seed, p + "attn_k_norm", hd, nz)),
            TensorPlan(p + "attn_output.weight", (d, qw), matrix, scales.attn_out / math.sqrt(qw),
                       zero_rows=CODE_CHANNELS),
            TensorPlan(p + "ffn_norm.weight", (d,), T.F32, data=norm_weight(seed, p + "ffn_norm", d, nz)),
            TensorPlan(p + "ffn_gate_inp.weight", (e, d), T.F32, data=routers[i]),
            TensorPlan(p + "ffn_gate_exps.weight", (e, f, d), matrix, scales.expert_in / math.sqrt(d),
                       blind=True),
            TensorPlan(p + "ffn_up_exps.weight", (e, f, d), matrix, scales.expert_in / math.sqrt(d),
                       blind=True),
            TensorPlan(p + "ffn_down_exps.weight", (e, d, f), matrix, scales.expert_out / math.sqrt(f),
                       zero_rows=CODE_CHANNELS),
        ]
    plans += [
        TensorPlan("output_norm.weight", (d,), T.F32, data=norm_weight(seed, "output_norm", d, nz)),
        TensorPlan("output.weight", (v, d), output, scales.output / math.sqrt(d), blind=True),
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
