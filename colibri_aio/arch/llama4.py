"""llama4 (Llama 4 Scout, Maverick; the text model): MoE blocks interleaved with dense-FFN blocks, a
shared expert beside one sigmoid-weighted routed expert, chunked attention, NoPE layers with a query
temperature, weightless q/k RMSNorm on the RoPE layers, llama3 RoPE frequency factors (NORMAL RoPE).

llama.cpp's ``llama4`` graph (src/models/llama4.cpp, build_moe_ffn) is the reference. Where it and
transformers' Llama4ForCausalLM differ, this module follows llama.cpp:

- the chunk (``attention_chunk_size``), the NoPE period (``no_rope_layer_interval``) and the temperature
  (``floor_scale``, ``attn_scale``) are not in the file: llama.cpp fixes chunks of 8192 positions, every
  4th block NoPE, floor 8192 and scale 0.1 (Scout's and Maverick's values), and so does this module.
  Which blocks are chunked is ``attention.sliding_window_pattern`` (default: 3 of every 4); a file with
  ``attention.sliding_window`` 0 (the converter's mark of a model without chunked layers) has no chunked
  block and only its last block is NoPE ((il + 1) % block_count == 0, as llama.cpp computes it);
- the q/k norm is on when the expert count is not 128 (llama.cpp tells Maverick by its 128 experts and
  reads no key), whatever the config's ``use_qk_norm`` said;
- routing: the top-k of the raw router logits, each weighed by sigmoid(logit), the weight multiplying the
  expert's input (``weight_before_ffn``); the shared expert (``ffn_*_shexp``) is added unweighted. Here
  the experts are chosen by sigmoid(logit), the same order unless float32 sigmoids tie (|logit| > ~17).

Blocks ``(i + 1) % interleave_moe_layer_step == 0`` have experts; the others a dense FFN of
``feed_forward_length``. The NoPE blocks multiply their queries by 1 + 0.1 ln(floor((p + 1) / 8192) + 1),
which is 1 before position 8191.

Shape legend as in :mod:`colibri_aio.arch.layers`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Self

import numpy as np

from colibri_aio.arch.base import (BaseArgs, Family, Metadata, TensorSpec, attention_tensors, ffn_tensors,
                                   router_tensors, vector)
from colibri_aio.arch.decode_graphs import GraphDecode
from colibri_aio.arch.graph import Builder, RopeParams, Value
from colibri_aio.arch.gptoss import sliding_layers
from colibri_aio.arch.layers import Rope
from colibri_aio.errors import ModelFormatError
from colibri_aio.kernels.ops import Routing

# What llama.cpp's llama4 loader fixes rather than reads.
CHUNK = 8192
NO_ROPE_STEP = 4
CHUNK_PATTERN = 4
TEMPERATURE_FLOOR = 8192
TEMPERATURE_SCALE = 0.1
MAVERICK_EXPERTS = 128   # the expert count llama.cpp runs without the q/k norm


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelArgs(BaseArgs):
    """llama4's hyper-parameters: the shared set, the MoE period, the dense FFN width, which blocks are
    chunked and which rotate."""

    moe_layer_step: int            # interleave_moe_layer_step
    feed_forward_length: int       # the dense blocks' FFN width
    chunk: int | None              # positions of an attention chunk (None: no chunked block)
    chunked: tuple[bool, ...]      # per block
    no_rope_step: int              # block i rotates unless (i + 1) % no_rope_step == 0
    qk_norm: bool

    @classmethod
    def from_gguf(cls, meta: Metadata) -> Self:
        values = cls.common(meta, routing=Routing("sigmoid", normalize=False, scale=0.0))
        blocks = values["block_count"]
        window = meta.get("attention.sliding_window")
        if window is not None and int(window) == 0:
            chunk, chunked, no_rope = None, (False,) * blocks, blocks
        else:
            chunk, chunked, no_rope = CHUNK, sliding_layers(meta, blocks, CHUNK_PATTERN), NO_ROPE_STEP
        return cls(**values, moe_layer_step=int(meta.need("interleave_moe_layer_step")),
                   feed_forward_length=int(meta.need("feed_forward_length")), chunk=chunk, chunked=chunked,
                   no_rope_step=no_rope, qk_norm=values["expert_count"] != MAVERICK_EXPERTS)

    def is_moe(self, layer: int) -> bool:
        return (layer + 1) % self.moe_layer_step == 0

    def uses_rope(self, layer: int) -> bool:
        return (layer + 1) % self.no_rope_step != 0

    def kv_window(self, layer: int) -> int | None:
        return self.chunk if self.chunked[layer] else None

    def kv_chunked(self, layer: int) -> bool:
        return self.chunked[layer]

    def check(self, path: Path) -> None:
        if self.moe_layer_step < 1 or self.moe_layer_step > self.block_count:
            raise ModelFormatError(f"{path}: llama4.interleave_moe_layer_step {self.moe_layer_step} leaves no "
                                   f"block with experts among {self.block_count}")
        BaseArgs.check(self, path)
        if self.key_length != self.value_length or self.n_rot != self.key_length:
            raise ModelFormatError(f"{path}: llama4 heads rotate all their dims: key_length {self.key_length}, "
                                   f"value_length {self.value_length} and rope dims {self.n_rot} must be equal")
        if self.moe_layer_step > 1 and self.feed_forward_length < 1:
            raise ModelFormatError(f"{path}: llama4.feed_forward_length must be positive (the dense blocks' FFN)")


def block_tensors(a: ModelArgs, layer: int) -> list[TensorSpec]:
    d = a.embedding_length
    if not a.is_moe(layer):
        return [*attention_tensors(a), vector("ffn_norm", d), *ffn_tensors(d, a.feed_forward_length)]
    return [*attention_tensors(a), *router_tensors(a), *ffn_tensors(d, a.expert_feed_forward_length, "_shexp")]


def global_tensors(a: ModelArgs) -> list[TensorSpec]:
    """rope_freqs (n_rot/2): each frequency divided by its factor (the converter writes it for llama3 RoPE)."""
    return [vector("rope_freqs", a.n_rot // 2, optional=True)]


class Llama4(GraphDecode):
    """A llama4 model bound to an expert source and a KV cache."""

    args: ModelArgs
    expert_weights_first = True

    def freq_factors(self) -> np.ndarray | None:
        return self.model.globals.get("rope_freqs")

    def rope_tables(self, positions: np.ndarray) -> Rope:
        a, factors = self.args, self.freq_factors()
        inv = a.rope_freq_base ** (-np.arange(0, a.n_rot, 2, dtype=np.float64) / a.n_rot)
        if factors is not None:
            inv = inv / factors.astype(np.float64)
        angles = positions.astype(np.float64)[:, None] * inv[None, :]
        return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)

    def rope_params(self) -> RopeParams:
        a, factors = self.args, self.freq_factors()
        return RopeParams(a.n_rot, a.rope_freq_base, a.context_length,
                          freq_factors=None if factors is None else tuple(float(x) for x in factors))

    def attention(self, f: Builder, layer: int, h: Value) -> Value:
        a = self.args
        q, k, v = self.qkv(f, self.model.blocks[layer], h)
        if not a.uses_rope(layer):
            return self.attend(f, layer, f.temperature(q, TEMPERATURE_FLOOR, TEMPERATURE_SCALE), k, v)
        q, k = f.rope(q, neox=False), f.rope(k, neox=False)
        if a.qk_norm:     # weightless RMSNorm of each head (transformers' Llama4TextL2Norm)
            ones = self.__dict__.setdefault("_ones", np.ones(a.key_length, np.float32))
            q, k = f.rms_norm(q, ones), f.rms_norm(k, ones)
        return self.attend(f, layer, q, k, v)


FAMILY = Family("llama4", ModelArgs, block_tensors, Llama4, checked_against="Llama4ForCausalLM",
                global_tensors=global_tensors)
