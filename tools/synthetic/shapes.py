"""Model shapes the generator knows, named as the GGUF keys name them.

``family`` is the GGUF ``general.architecture``. The fields after ``rms_eps``
describe what the families beyond qwen3moe add (fixtures/families.md has the
tensors and math of each); their defaults are qwen3moe's, so a qwen3moe shape
names none of them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Shape:
    """Hyper-parameters of one MoE model."""

    name: str
    block_count: int  # trunk blocks (NextN blocks come on top, see ``nextn``)
    expert_count: int
    expert_used_count: int
    embedding_length: int
    expert_feed_forward_length: int
    head_count: int
    head_count_kv: int
    head_dim: int
    vocab_size: int
    context_length: int
    rope_freq_base: float = 1e6
    rms_eps: float = 1e-6
    family: str = "qwen3moe"
    qk_norm: str = "head"           # "head" (per-head q/k RMSNorm), "whole" (olmoe: over the projection), "none"
    attn_bias: bool = False         # q/k/v biases (gpt-oss: o bias too)
    dense_lead: int = 0             # leading_dense_block_count
    dense_ff: int = 0               # feed_forward_length of the dense blocks
    shared_count: int = 0           # shared experts (deepseek2, glm4moe: width F * count)
    shared_ff: int = 0              # qwen2moe's shared expert width (with a sigmoid gate)
    gating: str = "softmax"         # "softmax" or "sigmoid" (+ exp_probs_b correction bias)
    group_count: int = 0            # expert_group_count (0: key not written)
    group_used: int = 0
    weights_scale: float = 0.0      # expert_weights_scale (0: not written)
    weights_norm: bool = False      # expert_weights_norm written (true)
    rope_dim: int = 0               # rope.dimension_count (0: not written, = head_dim)
    yarn_factor: float = 0.0        # YaRN rope scaling (0: none)
    yarn_orig_ctx: int = 0
    yarn_log_mul: float = 0.0       # deepseek2's rope.scaling.yarn_log_multiplier
    q_lora_rank: int = 0            # MLA (deepseek2) when kv_lora_rank > 0
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    sliding_window: int = 0         # gpt-oss: even blocks slide, odd blocks are full
    nextn: int = 0                  # glm4moe's NextN (MTP) blocks appended after the trunk
    # qwen3next's gated DeltaNet: every block but each full_attention_interval-th (0: none)
    full_attention_interval: int = 0
    linear_key_heads: int = 0       # ssm.group_count
    linear_value_heads: int = 0     # ssm.time_step_rank
    linear_head_dim: int = 0        # ssm.state_size (keys and values alike)
    conv_kernel: int = 0            # ssm.conv_kernel

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def q_width(self) -> int:
        """Rows of attn_q (MLA: of attn_q_b)."""
        return self.head_count * (self.qk_nope_dim + self.qk_rope_dim if self.mla else self.head_dim)

    @property
    def kv_width(self) -> int:
        return self.head_count_kv * self.head_dim

    @property
    def o_width(self) -> int:
        """Columns of attn_output."""
        return self.head_count * (self.v_head_dim if self.mla else self.head_dim)

    @property
    def total_blocks(self) -> int:
        """block_count as the GGUF key says it: trunk plus NextN blocks."""
        return self.block_count + self.nextn

    def is_moe(self, block: int) -> bool:
        return block >= self.dense_lead

    def is_recurrent(self, block: int) -> bool:
        """A gated DeltaNet block (qwen3next) rather than an attention block."""
        return self.full_attention_interval > 0 and (block + 1) % self.full_attention_interval != 0

    @property
    def conv_channels(self) -> int:
        """The DeltaNet convolution's channels: q and k of every key head, v of every value head."""
        return (2 * self.linear_key_heads + self.linear_value_heads) * self.linear_head_dim


_MIXTRAL = dict(family="llama", qk_norm="none", rms_eps=1e-5)
_OLMOE = dict(family="olmoe", qk_norm="whole", rms_eps=1e-5, rope_freq_base=1e4)
_QWEN2MOE = dict(family="qwen2moe", qk_norm="none", attn_bias=True)
_DEEPSEEK2 = dict(family="deepseek2", qk_norm="none", gating="sigmoid", weights_norm=True, weights_scale=2.5,
                  rope_freq_base=1e4, yarn_factor=40.0, yarn_orig_ctx=4096, yarn_log_mul=0.1)
_GLM4MOE = dict(family="glm4moe", attn_bias=True, gating="sigmoid", weights_norm=True, rms_eps=1e-5,
                group_count=1, group_used=1, nextn=1)
_MINIMAX_M2 = dict(family="minimax-m2", qk_norm="whole", gating="sigmoid", rope_freq_base=5e6)
_QWEN3NEXT = dict(family="qwen3next", gating="softmax", rope_freq_base=1e7, full_attention_interval=4, conv_kernel=4)
_DOTS1 = dict(family="dots1", gating="sigmoid", weights_norm=True, weights_scale=2.5, group_count=1, group_used=1)
_ERNIE = dict(family="ernie4_5-moe", qk_norm="none", rms_eps=1e-5, rope_freq_base=500000.0)
_HUNYUAN = dict(family="hunyuan-moe", rms_eps=1e-5)
_LING2 = dict(family="bailingmoe2", gating="sigmoid", weights_norm=True, weights_scale=2.5, rope_freq_base=600000.0,
              group_count=8, group_used=4)
_GPTOSS = dict(family="gpt-oss", qk_norm="none", attn_bias=True, rms_eps=1e-5, rope_freq_base=150000.0,
               yarn_factor=32.0, yarn_orig_ctx=4096)

SHAPES: dict[str, Shape] = {
    # Qwen3-30B-A3B as its config.json describes it (context cut from 40960 on request).
    "qwen3-30b-a3b": Shape("qwen3-30b-a3b", block_count=48, expert_count=128, expert_used_count=8,
                           embedding_length=2048, expert_feed_forward_length=768, head_count=32,
                           head_count_kv=4, head_dim=128, vocab_size=151936, context_length=40960),
    # The families of fixtures/families.md, as their config.json files describe them.
    "mixtral-8x7b": Shape("mixtral-8x7b", block_count=32, expert_count=8, expert_used_count=2,
                          embedding_length=4096, expert_feed_forward_length=14336, head_count=32,
                          head_count_kv=8, head_dim=128, vocab_size=32000, context_length=32768, **_MIXTRAL),
    "olmoe-1b-7b": Shape("olmoe-1b-7b", block_count=16, expert_count=64, expert_used_count=8,
                         embedding_length=2048, expert_feed_forward_length=1024, head_count=16,
                         head_count_kv=16, head_dim=128, vocab_size=50304, context_length=4096, **_OLMOE),
    "qwen2-57b-a14b": Shape("qwen2-57b-a14b", block_count=28, expert_count=64, expert_used_count=8,
                            embedding_length=3584, expert_feed_forward_length=2560, head_count=28,
                            head_count_kv=4, head_dim=128, vocab_size=151936, context_length=65536,
                            shared_ff=20480, dense_ff=18944, **_QWEN2MOE),
    # 61 blocks, 3 dense; the MTP block is not converted (llama.cpp's converter skips it). Cut with --layers.
    "deepseek-v3": Shape("deepseek-v3", block_count=61, expert_count=256, expert_used_count=8,
                         embedding_length=7168, expert_feed_forward_length=2048, head_count=128,
                         head_count_kv=128, head_dim=192, vocab_size=129280, context_length=163840,
                         dense_lead=3, dense_ff=18432, shared_count=1, group_count=8, group_used=4,
                         q_lora_rank=1536, kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128,
                         rope_dim=64, **_DEEPSEEK2),
    "glm-4.5-air": Shape("glm-4.5-air", block_count=46, expert_count=128, expert_used_count=8,
                         embedding_length=4096, expert_feed_forward_length=1408, head_count=96,
                         head_count_kv=8, head_dim=128, vocab_size=151552, context_length=131072,
                         dense_lead=1, dense_ff=10944, shared_count=1, weights_scale=1.0, rope_dim=64,
                         **dict(_GLM4MOE, qk_norm="none")),
    "gpt-oss-120b": Shape("gpt-oss-120b", block_count=36, expert_count=128, expert_used_count=4,
                          embedding_length=2880, expert_feed_forward_length=2880, head_count=64,
                          head_count_kv=8, head_dim=64, vocab_size=201088, context_length=131072,
                          sliding_window=128, **_GPTOSS),
    # MiniMax-M2 (and M2.1: the same shape): partial RoPE, 64 of each head's 128 dims.
    "minimax-m2": Shape("minimax-m2", block_count=62, expert_count=256, expert_used_count=8,
                        embedding_length=3072, expert_feed_forward_length=1536, head_count=48, head_count_kv=8,
                        head_dim=128, vocab_size=200064, context_length=196608, rope_dim=64, **_MINIMAX_M2),
    # Qwen3-Next-80B-A3B: 3 of 4 blocks gated DeltaNet (16 key / 32 value heads of 128), every 4th gated full
    # attention (16 heads of 256, 2 KV heads, RoPE on 64 dims); 512 experts, top-10, a gated shared expert.
    "qwen3-next-80b-a3b": Shape("qwen3-next-80b-a3b", block_count=48, expert_count=512, expert_used_count=10,
                                embedding_length=2048, expert_feed_forward_length=512, head_count=16,
                                head_count_kv=2, head_dim=256, vocab_size=151936, context_length=262144,
                                shared_ff=512, rope_dim=64, linear_key_heads=16, linear_value_heads=32,
                                linear_head_dim=128, **_QWEN3NEXT),
    # dots.llm1 (base, inst): DeepSeek-V3's MoE (sigmoid, one group, 2 shared experts) on qwen3moe's attention.
    "dots.llm1": Shape("dots.llm1", block_count=62, expert_count=128, expert_used_count=6, embedding_length=4096,
                       expert_feed_forward_length=1408, head_count=32, head_count_kv=32, head_dim=128,
                       vocab_size=152064, context_length=32768, dense_lead=1, dense_ff=10944, shared_count=2,
                       **_DOTS1),
    # ERNIE-4.5-21B-A3B: one dense block, 2 shared experts written as one 3072-wide shared FFN.
    "ernie-4.5-21b-a3b": Shape("ernie-4.5-21b-a3b", block_count=28, expert_count=64, expert_used_count=6,
                               embedding_length=2560, expert_feed_forward_length=1536, head_count=20,
                               head_count_kv=4, head_dim=128, vocab_size=103424, context_length=131072,
                               dense_lead=1, dense_ff=12288, shared_ff=3072, shared_count=2, **_ERNIE),
    # ERNIE-4.5-300B-A47B: three dense blocks, no shared expert.
    "ernie-4.5-300b-a47b": Shape("ernie-4.5-300b-a47b", block_count=54, expert_count=64, expert_used_count=8,
                                 embedding_length=8192, expert_feed_forward_length=3584, head_count=64,
                                 head_count_kv=8, head_dim=128, vocab_size=103424, context_length=131072,
                                 dense_lead=3, dense_ff=28672, **_ERNIE),
    # Hunyuan-A13B: experts and the shared expert 3072 wide; freq_base as the converter computes it from the
    # NTK alpha (10000 x 1000^(128/126)).
    "hunyuan-a13b": Shape("hunyuan-a13b", block_count=32, expert_count=64, expert_used_count=8, embedding_length=4096,
                          expert_feed_forward_length=3072, head_count=32, head_count_kv=8, head_dim=128,
                          vocab_size=128167, context_length=262144, rope_freq_base=11158839.9251,
                          shared_ff=3072, shared_count=1, **_HUNYUAN),
    # Ling-flash-2.0 (bailingmoe2; Ring-flash-2.0 the same shape): fused q/k/v, RoPE on half of each head, 256
    # experts in 8 groups (4 used), one shared expert; the MTP block is not written.
    "ling-flash-2.0": Shape("ling-flash-2.0", block_count=32, expert_count=256, expert_used_count=8,
                            embedding_length=4096, expert_feed_forward_length=1024, head_count=32, head_count_kv=4,
                            head_dim=128, vocab_size=157184, context_length=32768, dense_lead=1, dense_ff=9216,
                            shared_count=1, rope_dim=64, **_LING2),
    # For tests: every quantised row length (256) is one K-quant super-block, and the
    # vocabulary is the shared 2048 tokens plus 2048 placeholders, so padding is exercised.
    "tiny": Shape("tiny", block_count=2, expert_count=16, expert_used_count=4, embedding_length=256,
                  expert_feed_forward_length=256, head_count=4, head_count_kv=2, head_dim=64,
                  vocab_size=4096, context_length=512),
}
_TINY = dict(block_count=2, expert_count=8, expert_used_count=2, embedding_length=256, expert_feed_forward_length=256,
             head_count=4, head_count_kv=2, head_dim=64, vocab_size=4096, context_length=512)
SHAPES |= {s.name: s for s in (
    Shape("tiny-mixtral", **_TINY, **_MIXTRAL),
    Shape("tiny-olmoe", **dict(_TINY, head_count_kv=4), **_OLMOE),
    Shape("tiny-qwen2moe", **_TINY, shared_ff=512, dense_ff=512, **_QWEN2MOE),
    Shape("tiny-deepseek2", **dict(_TINY, block_count=3, expert_count=16, expert_used_count=4, head_count_kv=4,
                                   head_dim=96), dense_lead=1, dense_ff=512, shared_count=1, group_count=4,
          group_used=2, q_lora_rank=256, kv_lora_rank=256, qk_nope_dim=64, qk_rope_dim=32, v_head_dim=64,
          rope_dim=32, **dict(_DEEPSEEK2, yarn_orig_ctx=64, yarn_factor=8.0)),
    Shape("tiny-glm4moe", **dict(_TINY, block_count=3), dense_lead=1, dense_ff=512, shared_count=1,
          weights_scale=2.5, rope_dim=32, **_GLM4MOE),
    Shape("tiny-gptoss", **_TINY, sliding_window=16, **_GPTOSS),
    Shape("tiny-minimax-m2", **_TINY, rope_dim=32, **_MINIMAX_M2),
    Shape("tiny-qwen3next", **dict(_TINY, block_count=4), shared_ff=256, rope_dim=16, linear_key_heads=2,
          linear_value_heads=4, linear_head_dim=64, **_QWEN3NEXT),
    Shape("tiny-dots1", **dict(_TINY, block_count=3, head_count_kv=4), dense_lead=1, dense_ff=512, shared_count=2,
          **_DOTS1),
    Shape("tiny-ernie4_5-moe", **dict(_TINY, block_count=3), dense_lead=1, dense_ff=512, shared_ff=512, shared_count=2,
          **_ERNIE),
    Shape("tiny-hunyuan-moe", **_TINY, shared_ff=256, shared_count=1, **_HUNYUAN),
    Shape("tiny-bailingmoe2", **dict(_TINY, block_count=3, expert_count=16, expert_used_count=4), dense_lead=1,
          dense_ff=512, shared_count=1, rope_dim=32, **dict(_LING2, group_count=4, group_used=2)),
)}
# For the codebook types (IQ1_S, IQ2_XXS, IQ3_XXS: 256-weight blocks with no zero code), whose experts can be
# blind to the code channels only by a whole zero block: the embedding spans two blocks.
SHAPES["tiny-deepseek2-wide"] = replace(SHAPES["tiny-deepseek2"], name="tiny-deepseek2-wide", embedding_length=512)


def resolve(name: str, layers: int | None = None, context: int | None = None) -> Shape:
    """The named shape, optionally cut to its first ``layers`` blocks and a shorter context."""
    shape = SHAPES[name]
    if layers is not None:
        if not 1 <= layers <= shape.block_count:
            raise ValueError(f"--layers must be in [1, {shape.block_count}] for {name}, got {layers}")
        shape = replace(shape, block_count=layers, dense_lead=min(shape.dense_lead, layers))
    if context is not None:
        if not 1 <= context <= shape.context_length:
            raise ValueError(f"--context must be in [1, {shape.context_length}] for {name}, got {context}")
        shape = replace(shape, context_length=context)
    return shape
