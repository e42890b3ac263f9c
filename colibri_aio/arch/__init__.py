"""Model families: one module per GGUF architecture, on shared layers, kernels and expert sources.

The loader reads ``general.architecture`` and asks :func:`family` for the
module's :class:`~colibri_aio.arch.base.Family`; the engine builds the forward
pass with :func:`build_net`. Modules are imported only when a file needs them.

    architecture   module         checked against (transformers)
    qwen3moe       qwen3moe.py    Qwen3MoeForCausalLM
    qwen2moe       qwen2moe.py    Qwen2MoeForCausalLM
    olmoe          olmoe.py       OlmoeForCausalLM
    llama          llama.py       MixtralForCausalLM (llama files with experts)
    deepseek2      deepseek2.py   DeepseekV3ForCausalLM, DeepseekV2ForCausalLM (lite: no q LoRA)
    gpt-oss        gptoss.py      GptOssForCausalLM
    glm4moe        glm4moe.py     Glm4MoeForCausalLM
    minimax-m2     minimax_m2.py  MiniMaxM2ForCausalLM
    llama4         llama4.py      Llama4ForCausalLM (the text model)
    qwen3next      qwen3next.py   Qwen3NextForCausalLM
    dots1          dots1.py       Dots1ForCausalLM
    ernie4_5-moe   ernie4_5_moe.py Ernie4_5_MoeForCausalLM
    hunyuan-moe    hunyuan_moe.py HunYuanMoEV1ForCausalLM
    bailingmoe2    bailingmoe2.py llama.cpp only (transformers has no class for it)

How to add a family (fixtures/families.md has each one's keys, tensors and
math as llama.cpp computes them):

1. ``arch/<family>.py`` with

   - ``ModelArgs(BaseArgs)``: a frozen, slotted, ``kw_only`` dataclass adding the
     family's own hyper-parameters; ``from_gguf(meta)`` calls
     ``BaseArgs.common(meta, **overrides)`` for the shared fields (override
     the ones the family reads from other keys or defaults otherwise), sets
     ``routing`` (:class:`~colibri_aio.kernels.ops.Routing`: softmax, sigmoid
     or softmax-weight gating, renormalisation, scale, expert groups) and
     ``skipped_blocks`` (NextN blocks the file holds but the graph never runs);
     ``check(path)`` adds its refusals; ``kv_layout`` changes when the
     cache holds something else than H_kv keys and values per position (MLA);
     ``kv_window(layer)`` names a block's sliding window (gpt-oss), which
     masks its attention and bounds its cache to a ring of that many positions;
   - ``block_tensors(args, layer)``: the block's resident tensors
     (``matrix``: raw bytes for the kernels; ``vector``: float32 norms, biases,
     routers). Routed experts (``ffn_{gate,up,down}_exps.weight``) are not
     listed: the loader finds them and the I/O layer streams them. Every other
     tensor of the file must be listed (optional ones marked), or the file is
     refused, as llama.cpp refuses tensors it does not expect;
   - the forward pass, a :class:`~colibri_aio.arch.decode_graphs.GraphDecode`
     subclass whose ``attention(f, layer, h)`` says the block's attention once,
     as operations of a :class:`~colibri_aio.arch.graph.Builder` ``f`` on the
     block's tensors, from the shared pieces (``qkv`` adds q/k/v biases when
     the block has them, ``attend`` keeps the KV cache and takes ``scale`` and
     ``sinks``, ``f.rope(x, neox=...)`` rotates the first n_rot dims). Both
     backends run that description: the NumPy reference and the per-operation
     pass at once, the ggml backend's decode steps as graphs traced from it.
     ``f.rope`` rotates as ``args.rope_scaling`` says (``arch.rope.RopeScaling``,
     read by ``common()`` from ``rope.scaling.*`` as llama.cpp reads it for every
     family: linear, YaRN; a family that reads more keys overrides it). A shared expert (``ffn_*_shexp``, gated by
     ``ffn_gate_inp_shexp`` when the file has it) and the leading dense blocks'
     FFN come with the tensors; ``expert_activation`` names another expert
     activation (expert biases ``ffn_*_exps.bias`` come with the file).
     ``make_cache`` for another cache layout. Routing (router logits +
     ``ffn_gate_inp.bias``, selection bias ``exp_probs_b.bias``, ``args.routing``),
     batch-union expert reads, the rank-ordered sum, lookahead and prefill
     chunking are shared;
   - ``FAMILY = Family(...)``; ``moe_norm`` when the MoE input norm is not
     ``ffn_norm`` (glm4moe and gpt-oss: ``post_attention_norm``).

2. One line in :data:`_MODULES`; oracle tests as tests/test_arch_families.py
   runs them (``FAMILY_FIXTURES``); the README's "What runs".

Blocks without routed experts (``ModelArgs.is_moe`` false: deepseek2's and glm4moe's
``leading_dense_block_count`` first blocks, llama4's interleaved ones) run ``dense_ffn``;
the loader keeps no expert table for them and the plan and the cache's per-layer quotas
count blocks with experts (``moe_block_count``). ``kv_chunked(layer)`` makes a block's
window a chunk (llama4); ``Family.global_tensors`` lists model-wide float32 tensors
(llama4's ``rope_freqs``), read into ``Model.globals``.
A KV cache holding something else than H_kv keys and values per position
(MLA's latent) is a :class:`~colibri_aio.arch.base.KVLayout` from
``ModelArgs.kv_layout``, which both the plan and the allocation read, as they
read ``kv_window`` (a sliding layer's ring holds its window, not the context).
A recurrent block (qwen3next's linear attention) keeps no keys but a state of
the sequence, ``ModelArgs.recurrent_state(layer)``, which the plan and the
allocation count in its place; the Builder's ``causal_conv`` and ``delta_net``
read it and write the state the step leaves, which becomes the sequence's only
when the step runs whole.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from colibri_aio.arch.kvcache import DEFAULT_KV_TYPE

if TYPE_CHECKING:
    from colibri_aio.arch.base import Family
    from colibri_aio.arch.layers import MoETransformer
    from colibri_aio.experts import ExpertSource
    from colibri_aio.gguf.model import Model
    from colibri_aio.kernels.backend import Kernels
    from colibri_aio.settings import Settings

# general.architecture -> module of colibri_aio.arch
_MODULES = {
    "qwen3moe": "qwen3moe",
    "qwen2moe": "qwen2moe",
    "olmoe": "olmoe",
    "llama": "llama",
    "deepseek2": "deepseek2",
    "gpt-oss": "gptoss",
    "glm4moe": "glm4moe",
    "minimax-m2": "minimax_m2",
    "llama4": "llama4",
    "qwen3next": "qwen3next",
    "dots1": "dots1",
    "ernie4_5-moe": "ernie4_5_moe",
    "hunyuan-moe": "hunyuan_moe",
    "bailingmoe2": "bailingmoe2",
}
SUPPORTED_ARCHITECTURES = tuple(_MODULES)


def family(architecture: str) -> Family:
    """The family of ``architecture``; KeyError for one the engine does not run."""
    module = importlib.import_module(f"colibri_aio.arch.{_MODULES[architecture]}")
    return module.FAMILY


def build_net(model: Model, experts: ExpertSource, n_ctx: int | None = None,
              kernels: Kernels | None = None, kv_type: str = DEFAULT_KV_TYPE,
              settings: Settings | None = None, n_seq: int = 1) -> MoETransformer:
    """The forward pass of ``model``'s family, bound to ``experts`` and ``n_seq`` KV caches (one per
    sequence it holds) of ``n_ctx`` positions stored as ``kv_type``, its products on ``kernels`` (None: the
    NumPy reference), with the engine's ``settings`` (None: read now)."""
    return model.family.net(model, experts, n_ctx, kernels, kv_type, settings, n_seq)
