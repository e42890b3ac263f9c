"""The hyper-parameter keys of a synthetic model, per family, as llama.cpp's converter writes them.

fixtures/families.md lists each family's keys and what llama.cpp reads from
them; the writer calls ``add_shape_keys`` under ``general.architecture = shape.family``.
"""
from __future__ import annotations

import gguf

from synthetic.shapes import Shape


def add_shape_keys(w: gguf.GGUFWriter, shape: Shape) -> None:
    """Dimensions, attention, RoPE and routing keys of ``shape`` (qwen3moe: the original key set)."""
    w.add_context_length(shape.context_length)
    w.add_embedding_length(shape.embedding_length)
    w.add_block_count(shape.total_blocks)
    w.add_feed_forward_length(shape.dense_ff or shape.expert_feed_forward_length)
    if shape.family != "olmoe":  # olmoe's experts are feed_forward_length wide
        w.add_expert_feed_forward_length(shape.expert_feed_forward_length)
    w.add_head_count(shape.head_count)
    w.add_head_count_kv(1 if shape.mla else shape.head_count_kv)
    if shape.mla:
        _add_mla(w, shape)
    elif shape.family not in ("qwen2moe", "olmoe"):  # those two derive d = D / H
        w.add_key_length(shape.head_dim)
        w.add_value_length(shape.head_dim)
    w.add_rope_freq_base(shape.rope_freq_base)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    w.add_expert_count(shape.expert_count)
    w.add_expert_used_count(shape.expert_used_count)
    _add_family(w, shape)


def _add_mla(w: gguf.GGUFWriter, shape: Shape) -> None:
    """deepseek2's MLA, written as MQA over the latent (see families.md)."""
    w.add_q_lora_rank(shape.q_lora_rank)
    w.add_kv_lora_rank(shape.kv_lora_rank)
    w.add_key_length(shape.kv_lora_rank + shape.qk_rope_dim)
    w.add_value_length(shape.kv_lora_rank)
    w.add_key_length_mla(shape.qk_nope_dim + shape.qk_rope_dim)
    w.add_value_length_mla(shape.v_head_dim)


def _add_family(w: gguf.GGUFWriter, shape: Shape) -> None:
    if shape.rope_dim:
        w.add_rope_dimension_count(shape.rope_dim)
    if shape.yarn_factor:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(shape.yarn_factor)
        w.add_rope_scaling_orig_ctx_len(shape.yarn_orig_ctx)
        w.add_rope_scaling_yarn_beta_fast(32.0)
        w.add_rope_scaling_yarn_beta_slow(1.0)
        if shape.yarn_log_mul:
            w.add_rope_scaling_yarn_log_mul(shape.yarn_log_mul)
    if shape.dense_lead or shape.family in ("deepseek2", "glm4moe", "bailingmoe2"):
        w.add_leading_dense_block_count(shape.dense_lead)
    if shape.family == "ernie4_5-moe":   # required by llama.cpp; every published ERNIE-4.5 MoE has 1
        w.add_interleave_moe_layer_step(1)
    if shape.shared_ff:
        w.add_expert_shared_feed_forward_length(shape.shared_ff)
    if shape.shared_count:
        w.add_expert_shared_count(shape.shared_count)
    if shape.group_count:
        w.add_expert_group_count(shape.group_count)
        w.add_expert_group_used_count(shape.group_used)
    if shape.gating == "sigmoid":
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if shape.weights_scale:
        w.add_expert_weights_scale(shape.weights_scale)
    if shape.weights_norm:
        w.add_expert_weights_norm(True)
    if shape.sliding_window:
        w.add_sliding_window(shape.sliding_window)
    if shape.nextn:
        w.add_nextn_predict_layers(shape.nextn)
    if shape.family in ("llama", "deepseek2"):
        w.add_vocab_size(shape.vocab_size)
    if shape.full_attention_interval:
        _add_deltanet(w, shape)


def _add_deltanet(w: gguf.GGUFWriter, shape: Shape) -> None:
    """qwen3next's linear attention, as its converter writes it (value heads as wide as key heads)."""
    w.add_ssm_conv_kernel(shape.conv_kernel)
    w.add_ssm_state_size(shape.linear_head_dim)
    w.add_ssm_group_count(shape.linear_key_heads)
    w.add_ssm_time_step_rank(shape.linear_value_heads)
    w.add_ssm_inner_size(shape.linear_value_heads * shape.linear_head_dim)
    w.add_array(f"{shape.family}.attention.recurrent_layers",
                [shape.is_recurrent(i) for i in range(shape.total_blocks)])
    w.add_full_attention_interval(shape.full_attention_interval)
