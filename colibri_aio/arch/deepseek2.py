"""deepseek2 (DeepSeek-V2/V2-Lite/V2.5/V3/R1, Kimi K2): multi-head latent attention (queries through
a q LoRA, or one attn_q in lite files), leading dense blocks, a shared expert, softmax or sigmoid
routing with a selection bias and expert groups, YaRN RoPE.

Attention is MLA in the absorbed form llama.cpp runs: the KV cache holds, per
position and block, one latent ``RMSNorm(c_kv)`` (kv_lora floats) and one
rotated key part ``k_rope`` shared by all heads — nothing per head. Each head's
no-position query part is carried into the latent space by ``attn_k_b``
(``q_abs = k_b_h · q_nope_h``), every head attends over the same latent keys
(MQA), and ``attn_v_b`` lifts each head's latent mix to its value width.

Shape legend as in :mod:`colibri_aio.arch.layers`, and: Lq q_lora_rank,
Lkv kv_lora_rank, dn the no-position part of a query head (qk_nope), dr its
rotated part (qk_rope = n_rot), dv the value head width.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Self

from colibri_aio.arch.base import (BaseArgs, Family, KVLayout, Metadata, TensorSpec, ffn_tensors, matrix,
                                   router_tensors, vector)
from colibri_aio.arch.graph import Builder, Tensor, Value
from colibri_aio.arch.decode_graphs import GraphDecode
from colibri_aio.arch.rope import RopeScaling
from colibri_aio.errors import ModelFormatError

# deepseek2.expert_gating_func as llama.cpp numbers it (0: unset, softmax for older DeepSeek-V2 files).
_GATING = {1: "softmax", 2: "sigmoid", 3: "softmax_weight"}


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelArgs(BaseArgs):
    """deepseek2's hyper-parameters.

    ``key_length``/``value_length`` (the shared fields) are what the file says:
    for MLA files the absorbed MQA head, Lkv + dr and Lkv; the per-head sizes
    are ``qk_nope``, ``n_rot`` and ``v_head``. ``split_kv_b``: the file has
    ``attn_k_b``/``attn_v_b`` (current converters, ``key_length_mla`` present),
    else one ``attn_kv_b`` (older files).
    """

    q_lora_rank: int              # 0: no q LoRA, one attn_q (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope: int
    v_head: int
    split_kv_b: bool
    feed_forward_length: int      # the leading dense blocks' FFN width
    expert_shared_count: int

    @classmethod
    def from_gguf(cls, meta: Metadata) -> Self:
        blocks, vocab = meta.block_count(), meta.vocab_size()
        # llama.cpp tells lite variants (DeepSeek-V2-Lite & co: one attn_q, no q LoRA) by their block count
        # and reads no q_lora_rank for them; other files without the key have no q LoRA either.
        lite = blocks in (26, 27) or (blocks == 48 and vocab == 128256)
        if lite or (meta.get("attention.q_lora_rank") is None and "blk.0.attn_q.weight" in meta.tensor_names):
            q_lora_rank = 0
        else:
            q_lora_rank = int(meta.need("attention.q_lora_rank"))
        gating = int(meta.get("expert_gating_func", 0))
        if gating == 0:  # older DeepSeek-V2 files: softmax; GLM-4.7-Lite written as deepseek2: sigmoid
            gating = 2 if blocks in (47, 48) and vocab == 154880 else 1
        if gating not in _GATING:
            raise ModelFormatError(f"{meta.path}: expert_gating_func {gating} is not supported (1 softmax, "
                                   f"2 sigmoid, 3 softmax over the chosen)")
        routing = meta.routing(_GATING[gating])
        # llama.cpp's deepseek2 alone reads rope.scaling.yarn_log_multiplier (mscale_all_dim)
        common = cls.common(meta, routing=routing, rope_scaling=RopeScaling.from_gguf(meta, log_multiplier=True))
        k_mla, v_mla = meta.get("attention.key_length_mla"), meta.get("attention.value_length_mla")
        split = bool(k_mla) and bool(v_mla)  # llama.cpp's is_mla()
        head_k = int(k_mla) if split else common["key_length"]
        n_rot = common["rope_dimension_count"] or common["key_length"]
        return cls(**common,
                   q_lora_rank=q_lora_rank,
                   kv_lora_rank=int(meta.need("attention.kv_lora_rank")),
                   qk_nope=head_k - n_rot,
                   v_head=int(v_mla) if split else common["value_length"],
                   split_kv_b=split,
                   feed_forward_length=int(meta.get("feed_forward_length", 0)),
                   expert_shared_count=int(meta.need("expert_shared_count")))

    def check(self, path: Path) -> None:
        BaseArgs.check(self, path)
        if min(self.kv_lora_rank, self.qk_nope, self.v_head) < 1 or self.q_lora_rank < 0:
            raise ModelFormatError(f"{path}: MLA sizes must be positive (q_lora_rank {self.q_lora_rank}, "
                                   f"kv_lora_rank {self.kv_lora_rank}, "
                                   f"key_length_mla - rope.dimension_count = {self.qk_nope}, value "
                                   f"length {self.v_head})")
        if self.split_kv_b and (self.key_length != self.kv_lora_rank + self.n_rot
                                or self.value_length != self.kv_lora_rank):
            raise ModelFormatError(
                f"{path}: key_length {self.key_length} / value_length {self.value_length} are not the latent "
                f"head kv_lora_rank + rope dims = {self.kv_lora_rank + self.n_rot} / {self.kv_lora_rank}")
        if self.expert_shared_count < 1:
            raise ModelFormatError(f"{path}: expert_shared_count must be positive for deepseek2")
        self.check_dense_width(path, self.feed_forward_length)
        s = self.rope_scaling
        if s.kind == "yarn" and (s.factor <= 1.0 or s.original_context < 1):
            raise ModelFormatError(f"{path}: YaRN needs rope.scaling.factor > 1 and an original context "
                                   f"(got {s.factor}, {s.original_context})")

    @property
    def head_k(self) -> int:
        """A query head's width before absorption: dn + dr."""
        return self.qk_nope + self.n_rot

    def kv_layout(self) -> KVLayout:
        """One latent key ``[RMSNorm(c_kv) | k_rope]`` per position (Lkv + dr floats), whose first Lkv
        floats are the value: no per-head keys or values."""
        return KVLayout(1, self.kv_lora_rank + self.n_rot, self.kv_lora_rank, values_in_keys=True)


def block_tensors(a: ModelArgs, layer: int) -> list[TensorSpec]:
    d, h, kl = a.embedding_length, a.head_count, a.kv_lora_rank
    if a.q_lora_rank:
        query = [matrix("attn_q_a", a.q_lora_rank, d), vector("attn_q_a_norm", a.q_lora_rank),
                 matrix("attn_q_b", h * a.head_k, a.q_lora_rank)]
    else:
        query = [matrix("attn_q", h * a.head_k, d)]
    # k_b/v_b are used per head (H products of small matrices): kept as the file's bytes, each head's rows
    # multiplied on the file's type as llama.cpp does (as float32 they were 4x the bytes, 67 MB a DeepSeek-V3
    # layer). An older file's one attn_kv_b is split into per-head views of its float32 copy.
    if a.split_kv_b:
        lift = [TensorSpec("attn_k_b", (h, kl, a.qk_nope)), TensorSpec("attn_v_b", (h, a.v_head, kl))]
    else:
        lift = [vector("attn_kv_b", h * (a.qk_nope + a.v_head), kl)]
    attention = [vector("attn_norm", d), *query, matrix("attn_kv_a_mqa", kl + a.n_rot, d),
                 vector("attn_kv_a_norm", kl), *lift, matrix("attn_output", d, h * a.v_head)]
    if not a.is_moe(layer):
        return [*attention, vector("ffn_norm", d), *ffn_tensors(d, a.feed_forward_length)]
    return [*attention, *router_tensors(a), vector("exp_probs_b.bias", a.expert_count, optional=True),
            *ffn_tensors(d, a.expert_feed_forward_length * a.expert_shared_count, "_shexp")]


class DeepSeek2(GraphDecode):
    """A deepseek2 model bound to an expert source and a latent KV cache."""

    args: ModelArgs

    def latent_lifts(self, layer: int) -> tuple[Tensor, Tensor]:
        """k_b (H, Lkv, dn) and v_b (H, dv, Lkv) of block ``layer``: the file's bytes, or float32 views into
        attn_kv_b in older files."""
        a, blk = self.args, self.model.blocks[layer]
        if a.split_kv_b:
            return blk["attn_k_b"], blk["attn_v_b"]
        kv_b = blk["attn_kv_b"].reshape(a.head_count, a.qk_nope + a.v_head, a.kv_lora_rank)
        return kv_b[:, :a.qk_nope].transpose(0, 2, 1), kv_b[:, a.qk_nope:]

    def query(self, f: Builder, layer: int, h: Value) -> Value:
        """q (T, H, dn + dr) through the q LoRA, attn_q_b · RMSNorm(attn_q_a · h), or attn_q · h without one."""
        a, blk = self.args, self.model.blocks[layer]
        if a.q_lora_rank:
            q = f.linear(blk.attn_q_b, f.rms_norm(f.linear(blk.attn_q_a, h), blk.attn_q_a_norm))
        else:
            q = f.linear(blk.attn_q, h)
        return f.heads(q, a.head_count, a.head_k)

    def attention(self, f: Builder, layer: int, h: Value) -> Value:
        a, blk = self.args, self.model.blocks[layer]
        kl = a.kv_lora_rank
        q_nope, q_rope = f.split(self.query(f, layer, h), (a.qk_nope, a.n_rot))    # (T, H, dn), (T, H, dr)
        c, c_rope = f.split(f.linear(blk.attn_kv_a_mqa, h), (kl, a.n_rot))        # (T, Lkv), (T, dr)
        latent = f.heads(f.rms_norm(c, blk.attn_kv_a_norm), 1, kl)                 # (T, 1, Lkv)
        k_rope = f.rope(f.heads(c_rope, 1, a.n_rot), neox=False)                   # (T, 1, dr)
        k_b, v_b = self.latent_lifts(layer)
        q_all = f.concat(f.head_products(k_b, q_nope), f.rope(q_rope, neox=False))  # (T, H, Lkv + dr)
        mix = f.attend(layer, q_all, f.concat(latent, k_rope), None,               # (T, H * Lkv)
                       scale=a.rope_scaling.kq_scale(a.head_k))
        o = f.head_products(v_b, f.heads(mix, a.head_count, kl))                  # (T, H, dv)
        return self.project_heads(f, layer, f.flat(o))


FAMILY = Family("deepseek2", ModelArgs, block_tensors, DeepSeek2,
                checked_against="DeepseekV3ForCausalLM, DeepseekV2ForCausalLM (lite)")
