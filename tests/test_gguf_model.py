"""Loading GGUFs: metadata, the resident trunk, expert byte ranges, and refusing broken files."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from colibri_aio.arch import SUPPORTED_ARCHITECTURES
from colibri_aio.errors import ModelFormatError
from colibri_aio.gguf.model import load

from support import FIXTURES, fixture, model_logits, rewrite_gguf, run_cli

# Each broken fixture and a phrase its one-line refusal must contain.
BAD = {
    "blocks_bad.gguf": "missing tensor blk.",
    "truncated_bad.gguf": "truncated",
    "shape_bad.gguf": "has shape",
    "arch_bad.gguf": "unsupported architecture",
    "experts_bad.gguf": "expert_used_count",
    "notgguf_bad.gguf": "not a GGUF",
    "quant_types/f64_experts_bad.gguf": "tensor blk.0.ffn_down_exps.weight has unsupported type F64",
}


def test_args_come_from_metadata() -> None:
    m = load(fixture("tiny_f32.gguf"))
    a = m.args
    assert (a.architecture, a.vocab_size, a.block_count) == ("qwen3moe", 2048, 2)
    assert a.expert_used_count <= a.expert_count and a.head_count % a.head_count_kv == 0
    assert a.rope_freq_base == 1e6 and not a.tied_output
    assert load(fixture("tiny_f32_tied.gguf")).args.tied_output


def test_expert_ranges_are_the_stacked_tensor_slices() -> None:
    """Each expert's three ranges hold exactly its slice of ffn_{gate,up,down}_exps."""
    path = fixture("tiny_q8_0.gguf")
    m, reader = load(path), GGUFReader(path)
    raw = np.fromfile(path, dtype=np.uint8)
    tensors = {t.name: t for t in reader.tensors}
    for layer in range(m.args.block_count):
        for proj in ("gate", "up", "down"):
            stacked = tensors[f"blk.{layer}.ffn_{proj}_exps.weight"].data
            for e in range(m.args.expert_count):
                r = getattr(m.expert(layer, e), proj)
                np.testing.assert_array_equal(raw[r.offset: r.offset + r.nbytes], np.asarray(stacked[e]).reshape(-1).view(np.uint8))


def test_trunk_is_resident_not_a_view_of_the_file() -> None:
    m = load(fixture("tiny_f32.gguf"))
    chain, a = [], m.token_embd.data
    while a is not None:  # the tensor is a view of the buffer the bulk read filled, never of the mapped file
        chain.append(a)
        a = getattr(a, "base", None)
    assert not any(isinstance(x, np.memmap) for x in chain) and m.trunk_read is not None
    assert m.trunk_read.wanted == m.trunk_nbytes <= m.trunk_read.nbytes
    assert m.trunk_nbytes > 0 and m.expert_nbytes_max == m.expert(0, 0).nbytes


@pytest.mark.parametrize("name,phrase", sorted(BAD.items()))
def test_broken_files_are_refused(name: str, phrase: str) -> None:
    with pytest.raises(ModelFormatError, match=phrase):
        load(fixture(name))


@pytest.mark.parametrize("name,phrase", sorted(BAD.items()))
def test_cli_refuses_broken_files_with_one_line_and_status_2(name: str, phrase: str, tmp_path) -> None:
    r = run_cli("logits", str(FIXTURES / name), "--ids", "1,2", "--out", str(tmp_path / "x.npy"))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and phrase in lines[0] and "Traceback" not in r.stderr, r.stderr
    assert r.stdout == ""


def test_a_made_up_tensor_type_is_refused_with_one_line(tmp_path) -> None:
    """A type id no ggml knows (here 200, written over blk.0.attn_q's Q8_0) names the tensor and the id."""
    src = FIXTURES / "quant_types" / "f64_experts_bad.gguf"
    data = bytearray(src.read_bytes())
    name = b"blk.0.attn_q.weight"
    at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)  # after the name: n_dims, dims, type
    n_dims = int.from_bytes(data[at: at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    assert int.from_bytes(data[type_at: type_at + 4], "little") == 8  # Q8_0, so the patch lands on the type
    data[type_at: type_at + 4] = (200).to_bytes(4, "little")
    path = tmp_path / "madeup_bad.gguf"
    path.write_bytes(bytes(data))
    r = run_cli("logits", str(path), "--ids", "1,2", "--out", str(tmp_path / "x.npy"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "tensor blk.0.attn_q.weight has unknown ggml type 200" in lines[0], r.stderr


def test_missing_file_is_a_user_error(tmp_path) -> None:
    r = run_cli("run", "--model", str(tmp_path / "nope.gguf"))
    assert r.returncode == 2 and "no such model file" in r.stderr


# --- families: dispatch on general.architecture, and each family's refusals -------------------------------


def test_loader_dispatches_on_the_architecture() -> None:
    for stem, arch, net in [("tiny_f32", "qwen3moe", "Qwen3MoE"), ("qwen2moe_f32", "qwen2moe", "Qwen2MoE"),
                            ("olmoe_f32", "olmoe", "OLMoE"), ("mixtral_f32", "llama", "Mixtral")]:
        m = load(fixture(f"{stem}.gguf"))
        assert m.args.architecture == m.family.architecture == arch and m.family.net.__name__ == net


def test_family_hyper_parameters_come_from_their_keys() -> None:
    q2 = load(fixture("qwen2moe_f32.gguf")).args
    assert (q2.expert_feed_forward_length, q2.expert_shared_feed_forward_length) == (32, 64)
    assert not q2.routing.normalize  # llama.cpp's qwen2moe never renormalises the top-k weights
    olmoe = load(fixture("olmoe_f32.gguf")).args
    assert (olmoe.expert_feed_forward_length, olmoe.expert_used_count, olmoe.routing.normalize) == (32, 4, False)
    mixtral = load(fixture("mixtral_f32.gguf")).args
    assert (mixtral.expert_feed_forward_length, mixtral.n_rot, mixtral.routing.normalize) == (32, 16, True)


# Files whose optional keys llama.cpp defaults, rewritten so that its default is the fixture's own value:
# (fixture, rewrite, the fields read, the values they must take). llama.cpp opens each without a warning.
LLAMA_CPP_DEFAULTS = {
    # qwen3moe: expert_feed_forward_length absent or 0 -> feed_forward_length / expert_used_count (32 = 64 / 2)
    "qwen3moe_no_expert_width": ("tiny_f32", dict(keys={"qwen3moe.feed_forward_length": 64},
                                                  drop_keys=("qwen3moe.expert_feed_forward_length",)),
                                 ("expert_feed_forward_length",), (32,)),
    "qwen3moe_zero_expert_width": ("tiny_f32", dict(keys={"qwen3moe.feed_forward_length": 64,
                                                          "qwen3moe.expert_feed_forward_length": 0}),
                                   ("expert_feed_forward_length",), (32,)),
    # qwen2moe: both widths 0 -> experts 64 / 2 = 32 wide, the shared expert 64 (feed_forward_length)
    "qwen2moe_zero_widths": ("qwen2moe_f32", dict(keys={"qwen2moe.expert_feed_forward_length": 0,
                                                        "qwen2moe.expert_shared_feed_forward_length": 0}),
                             ("expert_feed_forward_length", "expert_shared_feed_forward_length"), (32, 64)),
    # every key llama.cpp reads as one value or one per block (get_key_or_arr), written per block
    "per_block_arrays": ("tiny_f32", dict(keys={f"qwen3moe.{k}": [v, v] for k, v in (
        ("attention.head_count", 4), ("attention.head_count_kv", 2), ("expert_used_count", 2),
        ("feed_forward_length", 32), ("expert_feed_forward_length", 32))}),
        ("head_count", "head_count_kv", "expert_used_count", "expert_feed_forward_length"), (4, 2, 2, 32)),
}


@pytest.mark.parametrize("case", sorted(LLAMA_CPP_DEFAULTS))
def test_files_llama_cpp_opens_with_a_default_open_with_its_default(case: str, tmp_path) -> None:
    stem, rewrite, fields, values = LLAMA_CPP_DEFAULTS[case]
    path = rewrite_gguf(FIXTURES / f"{stem}.gguf", tmp_path / f"{case}.gguf", **rewrite)
    args = load(path).args
    assert tuple(getattr(args, f) for f in fields) == values
    ids = [1, 5, 9, 300, 17]
    np.testing.assert_array_equal(model_logits(path, ids), model_logits(FIXTURES / f"{stem}.gguf", ids))


def test_shared_experts_and_their_gate_are_resident_trunk() -> None:
    m = load(fixture("qwen2moe_q8_0.gguf"))
    blk = m.blocks[0]
    assert {"ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "ffn_gate_inp_shexp", "attn_q.bias"} <= set(blk.tensors)
    assert blk.ffn_gate_inp_shexp.shape == (m.args.embedding_length,)  # stored {D, 1}
    assert m.trunk_nbytes > sum(b.nbytes for b in load(fixture("qwen2moe_q8_0.gguf")).blocks) > 0
    assert len(m.experts[0]) == m.args.expert_count  # only ffn_*_exps are streamed


def test_unsupported_architecture_lists_the_supported_ones() -> None:
    assert SUPPORTED_ARCHITECTURES[:4] == ("qwen3moe", "qwen2moe", "olmoe", "llama")
    with pytest.raises(ModelFormatError, match="unsupported architecture 'mamba9' "
                                               rf"\(supported: {', '.join(SUPPORTED_ARCHITECTURES)}\)"):
        load(fixture("arch_bad.gguf"))


def _drop_block_tensor(name: str):
    return lambda n, a: [] if n == name else [(n, a)]


def _per_expert(n: str, a: np.ndarray):
    """The GGUF layout before stacked experts: blk.<i>.ffn_gate.<e>.weight, one tensor per expert."""
    if "_exps." not in n:
        return [(n, a)]
    return [(n.replace("_exps.", f".{e}."), a[e]) for e in range(a.shape[0])]


# (fixture, rewrite, phrase of the one-line refusal)
FAMILY_REFUSALS = {
    "dense_llama": ("mixtral_f32", dict(drop_keys=("llama.expert_count", "llama.expert_used_count")),
                    "is a dense model"),
    "foreign_tensor": ("mixtral_f32", dict(tensors=lambda n, a: [(n, a)] + (
        [("blk.0.attn_q_norm.weight", np.ones(64, np.float32))] if n == "blk.0.attn_norm.weight" else [])),
        "tensor blk.0.attn_q_norm.weight is not part of a llama model"),
    "per_expert_tensors": ("mixtral_f32", dict(tensors=_per_expert), "experts stored one tensor each"),
    "no_shared_gate": ("qwen2moe_f32", dict(tensors=_drop_block_tensor("blk.1.ffn_gate_inp_shexp.weight")),
                       "missing tensor blk.1.ffn_gate_inp_shexp.weight"),
    "no_expert_width": ("qwen2moe_f32", dict(drop_keys=("qwen2moe.expert_feed_forward_length",
                                                         "qwen2moe.feed_forward_length")),
                        "missing metadata key qwen2moe.expert_feed_forward_length"),
    "olmoe_no_width": ("olmoe_f32", dict(drop_keys=("olmoe.feed_forward_length",)),
                       "missing metadata key olmoe.feed_forward_length"),
    "heads_differ_per_block": ("mixtral_f32", dict(keys={"llama.attention.head_count_kv": [2, 4]}),
                               "llama.attention.head_count_kv differs between blocks"),
    "per_block_array_length": ("olmoe_f32", dict(keys={"olmoe.feed_forward_length": [32, 32, 32]}),
                               "olmoe.feed_forward_length holds 3 values for block_count 2"),
    "odd_rotation": ("mixtral_f32", dict(keys={"llama.rope.dimension_count": 15}),
                     "rope.dimension_count 15 must be even"),
    "wide_rotation": ("mixtral_f32", dict(keys={"llama.rope.dimension_count": 32}), "at most key_length 16"),
    # a block count no file of this size can hold: refused before per-block tables of billions are made
    "huge_block_count": ("gptoss_f32", dict(keys={"gpt-oss.block_count": 3212836864}),
                         "block_count 3212836864 is not a count of blocks"),
    "no_blocks": ("deepseek2_f32", dict(keys={"deepseek2.block_count": 0}), "block_count 0 is not a count"),
    "qk_norm_width": ("olmoe_f32", dict(tensors=lambda n, a: [(n, a[:16] if n == "blk.0.attn_q_norm.weight" else a)]),
                      "tensor blk.0.attn_q_norm.weight has shape"),
}


@pytest.mark.parametrize("case", sorted(FAMILY_REFUSALS))
def test_family_files_that_cannot_run_are_refused_in_one_line(case: str, tmp_path) -> None:
    stem, rewrite, phrase = FAMILY_REFUSALS[case]
    path = rewrite_gguf(FIXTURES / f"{stem}.gguf", tmp_path / f"{case}_bad.gguf", **rewrite)
    with pytest.raises(ModelFormatError, match=phrase):
        load(path)
    r = run_cli("logits", str(path), "--ids", "1,2", "--out", str(tmp_path / "x.npy"))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and phrase in lines[0] and "Traceback" not in r.stderr, r.stderr


def test_expert_groups_must_split_the_experts() -> None:
    from dataclasses import replace

    from colibri_aio.kernels.ops import Routing

    args = load(fixture("mixtral_f32.gguf")).args
    replace(args, routing=Routing("sigmoid", group_count=4, group_used=2)).check(FIXTURES)  # 8 experts: fine
    for routing in (Routing("sigmoid", group_count=3, group_used=1), Routing("sigmoid", group_count=4, group_used=5)):
        with pytest.raises(ModelFormatError, match="groups"):
            replace(args, routing=routing).check(FIXTURES)
