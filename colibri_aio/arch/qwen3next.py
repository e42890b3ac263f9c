"""qwen3next (Qwen3-Next-80B-A3B): gated DeltaNet linear attention on three blocks of every four, gated
full attention on the fourth, and in every block a softmax top-k MoE beside a gated shared expert.

llama.cpp's ``qwen3next`` graph (src/models/qwen3next.cpp, delta-net-base.cpp) is the reference:

- a recurrent block (``attention.recurrent_layers``, or every block but each ``full_attention_interval``-th)
  projects the normed input to q, k, v (``attn_qkv``: nk·dk, nk·dk, nv·dv rows) and a gate z
  (``attn_gate``, nv·dv), or all four from the older single ``ssm_in`` laid out per key head as
  [q, k, v·r, z·r] (r = nv / nk); q, k, v go through a causal depthwise convolution of
  ``ssm.conv_kernel`` taps (``ssm_conv1d``) and SiLU; q and k are L2-normed and repeated to the nv value
  heads (value head j reads key head j // r); per value head β = sigmoid(b) and the log-decay
  g = softplus(a + ``ssm_dt.bias``)·``ssm_a`` (ssm_a = -exp(A_log)), b and a from ``ssm_ba`` laid out per
  key head as [b·r, a·r]; the gated delta rule (:func:`~colibri_aio.kernels.ops.gated_delta_rule`) runs
  over a state of nv (dv × dk) maps; its output is RMSNormed per head (``ssm_norm``) times SiLU(z) and
  projected by ``ssm_out``;
- a full-attention block's ``attn_q`` gives each head's query and a gate side by side ([q, gate] per
  head); q and k are RMSNormed per head, NEOX-rotated on their first ``rope.dimension_count`` dims
  (a quarter of the head), and the heads' output is multiplied by sigmoid(gate) before ``attn_output``;
- the MoE input is ``post_attention_norm``; routing is a softmax over all experts, top-k renormalised,
  unscaled (the loader reads no ``expert_weights_scale``); the shared expert is gated by
  sigmoid(``ffn_gate_inp_shexp`` · h).

A recurrent block keeps, per sequence, the last K-1 convolution inputs and its nv state maps instead of
keys and values (:class:`~colibri_aio.arch.kvcache.RecurrentShape`): the plan counts them and a context
can be continued only from its end, never rewound into.

Shape legend as in :mod:`colibri_aio.arch.layers`; nk, nv key and value heads of the linear attention,
dk = dv their width (``ssm.state_size``), C = 2·nk·dk + nv·dv the convolution's channels.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Self

from colibri_aio.arch.base import BaseArgs, Family, Metadata, TensorSpec, ffn_tensors, matrix, vector
from colibri_aio.arch.decode_graphs import GraphDecode
from colibri_aio.arch.graph import Builder, Value
from colibri_aio.arch.kvcache import RecurrentShape
from colibri_aio.errors import ModelFormatError
from colibri_aio.kernels.ops import Routing

FULL_ATTENTION_INTERVAL = 4   # llama.cpp's default when the file has neither key


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelArgs(BaseArgs):
    """qwen3next's hyper-parameters: the shared set, the linear attention's sizes, which blocks are
    recurrent, the shared expert's width."""

    conv_kernel: int          # ssm.conv_kernel
    state_size: int           # ssm.state_size: dk = dv
    key_heads: int            # ssm.group_count: nk
    value_heads: int          # ssm.time_step_rank: nv
    inner_size: int           # ssm.inner_size: nv * dv
    recurrent: tuple[bool, ...]
    expert_shared_feed_forward_length: int

    @classmethod
    def from_gguf(cls, meta: Metadata) -> Self:
        blocks, nextn = meta.block_count(), int(meta.get("nextn_predict_layers", 0))
        if not 0 <= nextn < blocks:
            raise ModelFormatError(f"{meta.path}: nextn_predict_layers {nextn} leaves no trunk block "
                                   f"among block_count {blocks}")
        trunk = blocks - nextn
        layers = meta.get("attention.recurrent_layers")
        if layers is not None:
            if not isinstance(layers, list) or len(layers) != blocks:
                raise ModelFormatError(f"{meta.path}: qwen3next.attention.recurrent_layers must hold "
                                       f"{blocks} flags, one per block")
            recurrent = tuple(bool(x) for x in layers[:trunk])
        else:
            interval = int(meta.get("full_attention_interval", FULL_ATTENTION_INTERVAL))
            if interval < 1:
                raise ModelFormatError(f"{meta.path}: qwen3next.full_attention_interval must be positive")
            recurrent = tuple((i + 1) % interval != 0 for i in range(trunk))
        # llama.cpp: experts n_ff / k wide when their width is absent or 0; the shared expert n_ff wide
        expert = meta.expert_width()
        if expert is None:
            raise ModelFormatError(f"{meta.path}: missing metadata key qwen3next.expert_feed_forward_length "
                                   f"(nor qwen3next.feed_forward_length to default it from)")
        shared = int(meta.get("expert_shared_feed_forward_length", 0) or meta.get("feed_forward_length", 0))
        for layer in (i for i in range(trunk) if recurrent[i]):   # llama.cpp reads either projection layout
            if not ({f"blk.{layer}.attn_qkv.weight", f"blk.{layer}.attn_gate.weight"} <= meta.tensor_names
                    or f"blk.{layer}.ssm_in.weight" in meta.tensor_names):
                raise ModelFormatError(f"{meta.path}: recurrent block {layer} has neither attn_qkv and attn_gate "
                                       f"nor ssm_in")
        return cls(**cls.common(meta, block_count=trunk, skipped_blocks=nextn, expert_feed_forward_length=expert,
                                routing=Routing("softmax", normalize=True, scale=0.0)),
                   conv_kernel=int(meta.need("ssm.conv_kernel")), state_size=int(meta.need("ssm.state_size")),
                   key_heads=int(meta.need("ssm.group_count")), value_heads=int(meta.need("ssm.time_step_rank")),
                   inner_size=int(meta.need("ssm.inner_size")), recurrent=recurrent,
                   expert_shared_feed_forward_length=shared)

    def check(self, path: Path) -> None:
        BaseArgs.check(self, path)
        if min(self.conv_kernel, self.state_size, self.key_heads, self.value_heads) < 1 or self.conv_kernel < 2:
            raise ModelFormatError(f"{path}: qwen3next's ssm sizes must be positive (conv_kernel at least 2)")
        if self.value_heads % self.key_heads:
            raise ModelFormatError(f"{path}: qwen3next.ssm.time_step_rank {self.value_heads} (value heads) is not "
                                   f"a multiple of ssm.group_count {self.key_heads} (key heads)")
        if self.inner_size != self.value_heads * self.state_size:
            raise ModelFormatError(f"{path}: qwen3next.ssm.inner_size {self.inner_size} is not time_step_rank "
                                   f"{self.value_heads} x state_size {self.state_size}; this engine runs value "
                                   f"heads as wide as key heads")
        self.check_equal_head_widths(path)
        if self.expert_shared_feed_forward_length < 1:
            raise ModelFormatError(f"{path}: qwen3next needs the shared expert's width "
                                   f"(expert_shared_feed_forward_length or feed_forward_length)")

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_heads * self.state_size + self.inner_size

    def recurrent_state(self, layer: int) -> RecurrentShape | None:
        if not self.recurrent[layer]:
            return None
        return RecurrentShape(self.conv_channels, self.conv_kernel - 1, self.value_heads, self.state_size)


def block_tensors(a: ModelArgs, layer: int) -> list[TensorSpec]:
    d, dk, nv, inner = a.embedding_length, a.state_size, a.value_heads, a.inner_size
    common = [vector("attn_norm", d), vector("post_attention_norm", d), vector("ffn_gate_inp", a.expert_count, d),
              vector("ffn_gate_inp_shexp", d), *ffn_tensors(d, a.expert_shared_feed_forward_length, "_shexp")]
    if not a.recurrent[layer]:
        h, hkv, dh = a.head_count, a.head_count_kv, a.key_length
        return [*common, matrix("attn_q", 2 * h * dh, d), matrix("attn_k", hkv * dh, d),
                matrix("attn_v", hkv * dh, d), matrix("attn_output", d, h * dh),
                vector("attn_q_norm", dh), vector("attn_k_norm", dh)]
    return [*common,
            matrix("attn_qkv", a.conv_channels, d, optional=True), matrix("attn_gate", inner, d, optional=True),
            matrix("ssm_in", a.conv_channels + inner, d, optional=True),   # the older layout of both
            vector("ssm_conv1d", a.conv_channels, a.conv_kernel), vector("ssm_dt.bias", nv),
            vector("ssm_a", nv, bare=True), matrix("ssm_ba", 2 * nv, d), vector("ssm_norm", dk),
            matrix("ssm_out", d, inner)]


class Qwen3Next(GraphDecode):
    """A qwen3next model bound to an expert source, a KV cache and its blocks' recurrent state."""

    args: ModelArgs

    def attention(self, f: Builder, layer: int, h: Value) -> Value:
        return (self.linear_attention if self.args.recurrent[layer] else self.gated_attention)(f, layer, h)

    def gated_attention(self, f: Builder, layer: int, h: Value) -> Value:
        """Full attention with q/k RMSNorm, partial NEOX RoPE and a sigmoid gate on each head's output."""
        a, blk = self.args, self.model.blocks[layer]
        qg, k, v = f.linears((blk.attn_q, blk.attn_k, blk.attn_v), h)
        q, gate = f.split(f.heads(qg, a.head_count, 2 * a.key_length), (a.key_length, a.key_length))
        k, v = f.heads(k, a.head_count_kv, a.key_length), f.heads(v, a.head_count_kv, a.value_length)
        q, k = f.rms_norm(q, blk.attn_q_norm), f.rms_norm(k, blk.attn_k_norm)
        o = f.attend(layer, f.rope(q, neox=True), f.rope(k, neox=True), v)
        return self.project_heads(f, layer, f.mul(o, f.sigmoid(f.flat(gate))))

    def linear_attention(self, f: Builder, layer: int, h: Value) -> Value:
        """The gated DeltaNet block (module docstring)."""
        a, blk = self.args, self.model.blocks[layer]
        dk, nk, nv = a.state_size, a.key_heads, a.value_heads
        r = nv // nk
        qkv, z = self.qkvz(f, layer, h)
        mixed = f.silu(f.causal_conv(layer, qkv, blk.ssm_conv1d))                      # (T, C)
        q, k, v = f.split(mixed, (nk * dk, nk * dk, a.inner_size))
        q, k = (f.repeat_heads(f.l2_norm(f.heads(x, nk, dk)), r) for x in (q, k))      # (T, nv, dk)
        b, alpha = f.split(f.heads(f.linear(blk.ssm_ba, h), nk, 2 * r), (r, r))       # (T, nk, r) each
        beta = f.sigmoid(f.flat(b))                                                     # (T, nv)
        g = f.mul(f.softplus(f.add(f.flat(alpha), blk["ssm_dt.bias"])), blk.ssm_a)    # (T, nv)
        o = f.delta_net(layer, q, k, f.heads(v, nv, dk), g, beta)                       # (T, nv, dv)
        o = f.mul(f.rms_norm(o, blk.ssm_norm), f.silu(f.heads(z, nv, dk)))
        return f.linear(blk.ssm_out, f.flat(o))

    def qkvz(self, f: Builder, layer: int, h: Value) -> tuple[Value, Value]:
        """The convolution's input (T, C) and the output gate z (T, nv·dv): from attn_qkv and attn_gate, or
        from the older ssm_in, laid out per key head as [q, k, v·r, z·r]."""
        a, blk = self.args, self.model.blocks[layer]
        if "attn_qkv" in blk:
            qkv, z = f.linears((blk.attn_qkv, blk.attn_gate), h)
            return qkv, z
        dk, nk = a.state_size, a.key_heads
        vr = a.inner_size // nk
        q, k, v, z = f.split(f.heads(f.linear(blk.ssm_in, h), nk, 2 * dk + 2 * vr), (dk, dk, vr, vr))
        return f.concat(f.concat(f.flat(q), f.flat(k)), f.flat(v)), f.flat(z)


FAMILY = Family("qwen3next", ModelArgs, block_tensors, Qwen3Next, checked_against="Qwen3NextForCausalLM",
                moe_norm="post_attention_norm")
