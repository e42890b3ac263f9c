"""Model shapes the generator knows, named as the qwen3moe GGUF keys name them."""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Shape:
    """Hyper-parameters of one qwen3moe model."""

    name: str
    block_count: int
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

    @property
    def q_width(self) -> int:
        """Rows of attn_q (= columns of attn_output)."""
        return self.head_count * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.head_count_kv * self.head_dim


SHAPES: dict[str, Shape] = {
    # Qwen3-30B-A3B as its config.json describes it (context cut from 40960 on request).
    "qwen3-30b-a3b": Shape("qwen3-30b-a3b", block_count=48, expert_count=128, expert_used_count=8,
                           embedding_length=2048, expert_feed_forward_length=768, head_count=32,
                           head_count_kv=4, head_dim=128, vocab_size=151936, context_length=40960),
    # For tests: every quantised row length (256) is one K-quant super-block, and the
    # vocabulary is the shared 2048 tokens plus 2048 placeholders, so padding is exercised.
    "tiny": Shape("tiny", block_count=2, expert_count=16, expert_used_count=4, embedding_length=256,
                  expert_feed_forward_length=256, head_count=4, head_count_kv=2, head_dim=64,
                  vocab_size=4096, context_length=512),
}


def resolve(name: str, layers: int | None = None, context: int | None = None) -> Shape:
    """The named shape, optionally cut to its first ``layers`` blocks and a shorter context."""
    shape = SHAPES[name]
    if layers is not None:
        if not 1 <= layers <= shape.block_count:
            raise ValueError(f"--layers must be in [1, {shape.block_count}] for {name}, got {layers}")
        shape = replace(shape, block_count=layers)
    if context is not None:
        if not 1 <= context <= shape.context_length:
            raise ValueError(f"--context must be in [1, {shape.context_length}] for {name}, got {context}")
        shape = replace(shape, context_length=context)
    return shape
