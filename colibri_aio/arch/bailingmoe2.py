"""bailingmoe2 (Ling 2.0 / Ring 2.0: Ling-mini, Ling-flash, Ling-1T): fused q/k/v (``attn_qkv``), per-head
q/k RMSNorm, then NEOX RoPE on the first ``rope.dimension_count`` dims of each head; leading dense blocks;
routing as the file says (sigmoid with a selection bias and expert groups in the published models), the
chosen weights renormalised and scaled; a shared expert on every MoE block.

llama.cpp's ``llama_model_bailingmoe2`` is the reference:

- its loader requires ``expert_gating_func`` (a file without it is refused, as llama.cpp refuses it);
- ``attn_qkv`` is ``{D, D + 2·Hkv·d}``: the query part is the embedding width, so H·d must equal it;
- the shared expert is ``expert_shared_feed_forward_length`` (absent or 0: the expert width) times
  ``expert_shared_count`` wide;
- the file's last ``nextn_predict_layers`` blocks are the multi-token-prediction layer, which its graph
  never runs, and neither do we (``skipped_blocks``).

transformers has no class for it: the fixture is a hand-written checkpoint converted by llama.cpp's
converter, checked against llama.cpp alone (fixtures/make_bailingmoe2_fixture.py).

Shape legend as in :mod:`colibri_aio.arch.layers`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Self

from colibri_aio.arch.base import (BaseArgs, Family, Metadata, TensorSpec, ffn_tensors, matrix, router_tensors,
                                   vector)
from colibri_aio.arch.decode_graphs import GraphDecode
from colibri_aio.arch.graph import Builder, Value
from colibri_aio.errors import ModelFormatError

# bailingmoe2.expert_gating_func as llama.cpp numbers it.
_GATING = {1: "softmax", 2: "sigmoid"}


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelArgs(BaseArgs):
    """bailingmoe2's hyper-parameters: the shared set (``block_count`` without the NextN blocks), the dense
    blocks' FFN width and the shared expert's."""

    feed_forward_length: int
    expert_shared_feed_forward_length: int

    @classmethod
    def from_gguf(cls, meta: Metadata) -> Self:
        gating = meta.gating(_GATING)   # required by llama.cpp's loader
        blocks, nextn = meta.block_count(), int(meta.get("nextn_predict_layers", 0))
        if not 0 <= nextn < blocks:
            raise ModelFormatError(f"{meta.path}: nextn_predict_layers {nextn} leaves no trunk block "
                                   f"among block_count {blocks}")
        common = cls.common(meta, block_count=blocks - nextn, skipped_blocks=nextn,
                            routing=meta.routing(gating))
        width = int(meta.get("expert_shared_feed_forward_length", 0)) or common["expert_feed_forward_length"]
        return cls(**common, feed_forward_length=int(meta.get("feed_forward_length", 0)),
                   expert_shared_feed_forward_length=width * int(meta.need("expert_shared_count")))

    def check(self, path: Path) -> None:
        BaseArgs.check(self, path)
        self.check_equal_head_widths(path)
        if self.head_count * self.key_length != self.embedding_length:
            raise ModelFormatError(f"{path}: bailingmoe2's attn_qkv holds queries as wide as the embedding "
                                   f"({self.embedding_length}), not head_count x key_length "
                                   f"({self.head_count} x {self.key_length})")
        self.check_dense_width(path, self.feed_forward_length)


def block_tensors(a: ModelArgs, layer: int) -> list[TensorSpec]:
    d, kv = a.embedding_length, a.head_count_kv * a.key_length
    common = [vector("attn_norm", d), matrix("attn_qkv", d + 2 * kv, d), vector("attn_q_norm", a.key_length),
              vector("attn_k_norm", a.key_length), matrix("attn_output", d, a.head_count * a.value_length)]
    if not a.is_moe(layer):
        return [*common, vector("ffn_norm", d), *ffn_tensors(d, a.feed_forward_length)]
    return [*common, *router_tensors(a), vector("exp_probs_b.bias", a.expert_count, optional=True),
            *ffn_tensors(d, a.expert_shared_feed_forward_length, "_shexp")]


class BailingMoE2(GraphDecode):
    """A bailingmoe2 model bound to an expert source and a KV cache."""

    def attention(self, f: Builder, layer: int, h: Value) -> Value:
        a, blk = self.args, self.model.blocks[layer]
        kv = a.head_count_kv * a.key_length
        q, k, v = f.split(f.linear(blk.attn_qkv, h), (a.embedding_length, kv, kv))
        q = f.rope(f.rms_norm(f.heads(q, a.head_count, a.key_length), blk.attn_q_norm), neox=True)
        k = f.rope(f.rms_norm(f.heads(k, a.head_count_kv, a.key_length), blk.attn_k_norm), neox=True)
        return self.attend(f, layer, q, k, f.heads(v, a.head_count_kv, a.value_length))


FAMILY = Family("bailingmoe2", ModelArgs, block_tensors, BailingMoE2,
                checked_against="llama.cpp (no transformers class)")
