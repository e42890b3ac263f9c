"""tools/make_synthetic_gguf.py: valid, loadable, reproducible files; realistic routing is skewed."""
from __future__ import annotations

import asyncio
import hashlib
import io
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T, GGUFReader
from gguf.quants import dequantize

from colibri_aio.gguf.model import load
from colibri_aio.engine.mapped_source import MappedExpertSource
from colibri_aio.arch import SUPPORTED_ARCHITECTURES, build_net
from colibri_aio.arch.qwen3moe import Qwen3MoE
from colibri_aio.cli.route_stats import compute
from colibri_aio.text.tokenizer import Tokenizer
from colibri_aio.cli.route_trace import TraceRecorder, read_trace, trace_run

TOOLS = Path(__file__).resolve().parent.parent / "tools"
sys.path.insert(0, str(TOOLS))
import make_synthetic_gguf as msg  # noqa: E402
from synthetic.shapes import SHAPES  # noqa: E402
from synthetic.tensors import CODE_CHANNELS  # noqa: E402

TINY = SHAPES["tiny"]
TYPES = ("q8_0", "q4_k")
MODES = ("uniform", "realistic")
PROMPT = ("Lists are mutable sequences, typically used to store collections of homogeneous items. "
          "Tuples are immutable sequences, typically used to store collections of heterogeneous data. "
          "A dictionary maps hashable values to arbitrary objects.")


def make(out: Path, *extra: str) -> dict:
    return msg.main(["--shape", "tiny", "--out", str(out), "--quiet", *extra])


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """The tiny shape in both types and both routing modes (~9 MB each)."""
    root = tmp_path_factory.mktemp("synthetic")
    out = {}
    for qtype in TYPES:
        for mode in MODES:
            path = root / f"tiny_{qtype}_{mode}.gguf"
            make(path, "--type", qtype, "--routing", mode)
            out[qtype, mode] = path
    return out


def tensors(path: Path) -> dict:
    return {t.name: t for t in GGUFReader(path).tensors}


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("mode", MODES)
def test_loads_with_requested_dims_and_types(models, qtype: str, mode: str) -> None:
    path = models[qtype, mode]
    a = load(path).args
    assert (a.block_count, a.expert_count, a.expert_used_count) == (TINY.block_count, TINY.expert_count,
                                                                     TINY.expert_used_count)
    assert (a.embedding_length, a.expert_feed_forward_length, a.vocab_size) == (
        TINY.embedding_length, TINY.expert_feed_forward_length, TINY.vocab_size)
    assert (a.head_count, a.head_count_kv, a.key_length, a.rope_freq_base) == (4, 2, 64, 1e6)
    matrix, embd, output, _ = msg.TYPE_MIXES[qtype]
    for name, t in tensors(path).items():
        if name.endswith("norm.weight") or "ffn_gate_inp" in name:
            want = T.F32
        elif name == "token_embd.weight":
            want = embd
        elif name == "output.weight":
            want = output
        else:
            want = matrix
        assert t.tensor_type == want, name
    reader = GGUFReader(path)
    assert f"routing={mode}" in reader.fields["general.description"].contents()
    assert reader.fields["synthetic.routing"].contents() == mode


@pytest.mark.parametrize("qtype", TYPES)
def test_blocks_dequantise_to_the_intended_std(models, qtype: str) -> None:
    """gguf's own dequantiser reads every block type back as finite weights of the planned std."""
    ts = tensors(models[qtype, "uniform"])
    d, f = TINY.embedding_length, TINY.expert_feed_forward_length
    for name, std in (("blk.0.attn_q.weight", 1 / math.sqrt(d)), ("blk.1.ffn_up_exps.weight", 1 / math.sqrt(d)),
                      ("output.weight", 1 / math.sqrt(d))):
        w = dequantize(ts[name].data, ts[name].tensor_type)
        assert np.isfinite(w).all()
        assert not w[..., :CODE_CHANNELS].any(), name  # the code channels are read by routers only
        rest = w[..., CODE_CHANNELS:]
        assert rest.std() == pytest.approx(std, rel=0.05), name
        assert abs(rest.mean()) < 0.05 * std, name
    if qtype == "q8_0":
        raw = np.asarray(ts["blk.0.attn_q.weight"].data).reshape(-1, 34)
        assert not (raw[:, 2:].view(np.int8) == -128).any()  # ggml never writes -128
    down = dequantize(ts["blk.0.ffn_down_exps.weight"].data, ts["blk.0.ffn_down_exps.weight"].tensor_type)
    assert down.shape == (TINY.expert_count, d, f)
    assert not down[:, :CODE_CHANNELS].any()  # ... and written by the embedding only
    assert down[:, CODE_CHANNELS:].std() == pytest.approx(1 / math.sqrt(f), rel=0.05)
    embd = dequantize(ts["token_embd.weight"].data, ts["token_embd.weight"].tensor_type)
    code = embd[:, :CODE_CHANNELS]
    assert (code == code[0]).all() and (np.abs(code[0]) == np.abs(code[0, 0])).all()


def test_same_seed_same_bytes_and_a_cut_is_a_prefix(tmp_path: Path) -> None:
    a, b, cut = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "cut.gguf"
    make(a, "--type", "q4_k", "--seed", "7")
    make(b, "--type", "q4_k", "--seed", "7")
    make(cut, "--type", "q4_k", "--seed", "7", "--layers", "1")
    assert hashlib.sha256(a.read_bytes()).digest() == hashlib.sha256(b.read_bytes()).digest()
    full, one = tensors(a), tensors(cut)
    assert set(one) == {n for n in full if not n.startswith("blk.1.")}
    for name in one:
        assert np.array_equal(np.asarray(one[name].data), np.asarray(full[name].data)), name


def test_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    out = tmp_path / "m.gguf"
    out.write_bytes(b"keep me")
    with pytest.raises(SystemExit, match="--force"):
        make(out)
    assert out.read_bytes() == b"keep me"
    make(out, "--force")
    load(out)


def test_padded_vocabulary_tokenises_like_the_shared_tokenizer(models) -> None:
    tok = Tokenizer.from_path(models["q8_0", "uniform"])
    assert tok.vocab_size == TINY.vocab_size
    ids = tok.encode(PROMPT)
    assert ids and max(ids) < 2048  # placeholders are never produced from text
    assert tok.decode(ids) == PROMPT


def _entropy(path: Path, tmp_path: Path) -> float:
    """Mean expert-use entropy over layers of a prefill-only trace of PROMPT."""
    model = load(path)
    ids = Tokenizer.from_gguf(model.reader).encode(PROMPT)
    out = io.StringIO()
    recorder = TraceRecorder(model, out)
    recorder.header()
    net = Qwen3MoE(model, MappedExpertSource(model), n_ctx=len(ids))
    asyncio.run(trace_run(net, recorder, 0, ids, 0, lambda logits: 0, lambda t: False))
    trace = tmp_path / f"{path.stem}.jsonl"
    trace.write_text(out.getvalue())
    stats = compute(read_trace(str(trace)))
    return float(np.mean([s.entropy for s in stats.layers]))


def test_realistic_routing_is_more_skewed_than_uniform(models, tmp_path: Path) -> None:
    uniform = _entropy(models["q8_0", "uniform"], tmp_path)
    realistic = _entropy(models["q8_0", "realistic"], tmp_path)
    assert realistic < uniform - 0.04, (uniform, realistic)


@pytest.mark.parametrize("qtype", TYPES)
def test_llama_cpp_evaluates_finite_logits(models, qtype: str) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(models[qtype, "realistic"]), n_threads=2, n_ctx=64,
                          logits_all=True, verbose=False)
    ids = llm.tokenize(b"Lists are mutable sequences", add_bos=False)
    llm.eval(ids)
    logits = np.asarray(llm.scores[: len(ids)])
    assert llm.n_vocab() == TINY.vocab_size
    assert np.isfinite(logits).all() and 0.3 < logits.std() < 5


# ---------------------------------------------------------------------------
# the other families' shapes (fixtures/families.md): tiny versions written and run by llama.cpp
# ---------------------------------------------------------------------------

# tensors each family's block 1 (an MoE block) must hold beyond the common ones, as llama.cpp loads them
FAMILY_TENSORS = {
    "tiny-mixtral": ("llama", {"attn_q", "ffn_norm", "ffn_gate_inp", "ffn_gate_exps"}),
    "tiny-olmoe": ("olmoe", {"attn_q_norm", "attn_k_norm", "ffn_norm", "ffn_down_exps"}),
    "tiny-qwen2moe": ("qwen2moe", {"attn_q.bias", "ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_down_shexp"}),
    "tiny-deepseek2": ("deepseek2", {"attn_q_a", "attn_q_a_norm", "attn_q_b", "attn_kv_a_mqa", "attn_kv_a_norm",
                                     "attn_k_b", "attn_v_b", "exp_probs_b.bias", "ffn_up_shexp"}),
    "tiny-glm4moe": ("glm4moe", {"attn_q.bias", "attn_q_norm", "post_attention_norm", "exp_probs_b.bias",
                                 "ffn_gate_shexp"}),
    "tiny-minimax-m2": ("minimax-m2", {"attn_q_norm", "attn_k_norm", "exp_probs_b.bias", "ffn_up_exps"}),
    "tiny-gptoss": ("gpt-oss", {"attn_sinks", "attn_output.bias", "ffn_gate_inp.bias", "ffn_up_exps.bias",
                                "post_attention_norm"}),
    "tiny-qwen3next": ("qwen3next", {"attn_qkv", "attn_gate", "ssm_conv1d", "ssm_dt.bias", "ssm_a", "ssm_ba",
                                     "ssm_norm", "ssm_out", "post_attention_norm", "ffn_gate_inp_shexp"}),
    "tiny-dots1": ("dots1", {"attn_q_norm", "attn_k_norm", "ffn_norm", "exp_probs_b.bias", "ffn_gate_shexp"}),
    "tiny-ernie4_5-moe": ("ernie4_5-moe", {"attn_q", "ffn_norm", "ffn_gate_inp", "ffn_up_shexp"}),
    "tiny-hunyuan-moe": ("hunyuan-moe", {"attn_q_norm", "attn_k_norm", "ffn_norm", "ffn_down_shexp"}),
    "tiny-bailingmoe2": ("bailingmoe2", {"attn_qkv", "attn_q_norm", "attn_k_norm", "exp_probs_b.bias", "ffn_up_shexp"}),
}


FAMILY_FILES = sorted((s, q) for s in FAMILY_TENSORS for q in (("q4_k", "mxfp4") if s == "tiny-gptoss" else ("q4_k",)))


def _block_names(path: Path, block: int) -> set[str]:
    prefix = f"blk.{block}."
    return {t.name[len(prefix):].removesuffix(".weight") for t in GGUFReader(path).tensors
            if t.name.startswith(prefix)}


@pytest.fixture(scope="module")
def family_models(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """Each tiny family shape in Q4_K (gpt-oss also MXFP4), uniform routing (~4-7 MB each)."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for shape, qtype in FAMILY_FILES:
        path = root / f"{shape}_{qtype}.gguf"
        msg.main(["--shape", shape, "--type", qtype, "--out", str(path), "--quiet"])
        out[shape, qtype] = path
    return out


@pytest.mark.parametrize("shape", sorted(FAMILY_TENSORS))
def test_family_shape_has_its_architecture_keys_and_tensors(family_models, shape: str) -> None:
    arch, extra = FAMILY_TENSORS[shape]
    s = SHAPES[shape]
    path = family_models[shape, "q4_k"]
    fields = GGUFReader(path).fields
    assert fields["general.architecture"].contents() == arch
    assert fields[f"{arch}.block_count"].contents() == s.total_blocks
    assert fields[f"{arch}.expert_count"].contents() == s.expert_count
    # routers are fitted by the engine's forward pass, for the families it runs
    assert ("not fitted" in fields["general.description"].contents()) == (arch not in SUPPORTED_ARCHITECTURES)
    assert extra <= _block_names(path, 1), extra - _block_names(path, 1)
    if s.dense_lead:
        assert {"ffn_gate", "ffn_up", "ffn_down"} <= _block_names(path, 0)
        assert "ffn_gate_inp" not in _block_names(path, 0)
    if s.nextn:
        assert {"nextn.eh_proj", "nextn.enorm", "nextn.hnorm"} <= _block_names(path, s.block_count)


def test_mxfp4_experts_and_q5_0_fallback_dequantise_to_the_intended_std(family_models) -> None:
    s = SHAPES["tiny-gptoss"]
    ts = tensors(family_models["tiny-gptoss", "mxfp4"])
    up = ts["blk.0.ffn_up_exps.weight"]
    assert up.tensor_type == T.MXFP4 and ts["blk.0.attn_q.weight"].tensor_type == T.Q8_0
    w = dequantize(up.data, up.tensor_type)
    assert not w[..., :CODE_CHANNELS].any()  # blind to the code channels, as every expert
    assert w[..., CODE_CHANNELS:].std() == pytest.approx(1 / math.sqrt(s.embedding_length), rel=0.05)
    # DeepSeek's attn_k_b rows (qk_nope = 64) are not whole Q4_K super-blocks: Q5_0, as llama.cpp falls back
    kb = tensors(family_models["tiny-deepseek2", "q4_k"])["blk.1.attn_k_b.weight"]
    assert kb.tensor_type == T.Q5_0
    assert dequantize(kb.data, kb.tensor_type).std() == pytest.approx(1 / math.sqrt(64), rel=0.05)


@pytest.mark.parametrize("qtype", ["iq1_s", "iq2_xxs", "iq3_xxs"])
def test_codebook_experts_dequantise_to_the_intended_std_and_the_engine_runs_them(tmp_path: Path,
                                                                                  qtype: str) -> None:
    """unsloth-style low-bit files: experts at the codebook type, the trunk Q4_K, the head Q6_K; gguf reads the
    experts back at the planned std, blind to the code (their whole first block), and the engine runs the file."""
    s = SHAPES["tiny-deepseek2-wide"]
    path = tmp_path / f"wide_{qtype}.gguf"
    msg.main(["--shape", s.name, "--type", qtype, "--out", str(path), "--quiet"])
    ts = tensors(path)
    up = ts["blk.1.ffn_up_exps.weight"]
    assert up.tensor_type == msg.EXPERT_TYPES[qtype] and ts["blk.1.attn_q_a.weight"].tensor_type == T.Q4_K
    assert ts["output.weight"].tensor_type == T.Q6_K
    w = dequantize(up.data, up.tensor_type)
    assert np.isfinite(w).all() and not w[..., :256].any()
    assert w[..., 256:].std() == pytest.approx(1 / math.sqrt(s.embedding_length), rel=0.05)
    assert abs(w[..., 256:].mean()) < 0.05 / math.sqrt(s.embedding_length)
    down = ts["blk.1.ffn_down_exps.weight"]
    assert not dequantize(down.data, down.tensor_type)[:, :CODE_CHANNELS].any()  # writes no code channel
    model = load(path)
    net = build_net(model, MappedExpertSource(model), n_ctx=8)
    logits = asyncio.run(net.forward([1, 2, 3, 4], logits="all"))
    assert np.isfinite(logits).all() and 0.3 < logits.std() < 5


def test_a_codebook_type_on_rows_of_one_block_is_refused_in_one_line(capsys) -> None:
    """Experts 256 wide at IQ2_XXS could only be blind to the code by being all zeros: refused, not written."""
    with pytest.raises(SystemExit) as exc:
        msg.main(["--shape", "tiny-deepseek2", "--type", "iq2_xxs", "--out", "/nonexistent/x.gguf", "--quiet"])
    assert str(exc.value).startswith("make_synthetic_gguf: blk.") and "IQ2_XXS" in str(exc.value)
    assert "\n" not in str(exc.value)


# published total parameter counts (billions), without MTP layers except GLM-4.5-Air's NextN block
PUBLISHED_PARAMS = {"qwen3-30b-a3b": 30.5, "minimax-m2": 229.0, "mixtral-8x7b": 46.7, "olmoe-1b-7b": 6.9, "qwen2-57b-a14b": 57.4,
                    "deepseek-v3": 671.0, "glm-4.5-air": 109.2, "gpt-oss-120b": 116.8,
                    "qwen3-next-80b-a3b": 80.0}   # Qwen3-Next's model card: "80B in total" (79.7 here, no MTP block)


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_full_shapes_have_the_published_parameter_counts(name: str) -> None:
    """The tensor plan of each real shape (no file written) counts its model's parameters."""
    from synthetic.tensors import plan_tensors

    s = SHAPES[name]
    routers = [np.zeros((s.expert_count, s.embedding_length), np.float32)] * s.total_blocks
    plans = plan_tensors(s, T.Q4_K, T.Q4_K, T.Q6_K, routers, 0)
    assert sum(math.prod(p.shape) for p in plans) / 1e9 == pytest.approx(PUBLISHED_PARAMS[name], rel=0.005)


@pytest.mark.parametrize("key", FAMILY_FILES, ids=["-".join(k) for k in FAMILY_FILES])
def test_llama_cpp_runs_each_family_shape(family_models, key) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(family_models[key]), n_threads=2, n_ctx=64, logits_all=True, verbose=False)
    try:
        ids = llm.tokenize(b"Lists are mutable sequences, typically used to store collections", add_bos=False)
        llm.eval(ids)
        logits = np.asarray(llm.scores[: len(ids)])
    finally:
        llm.close()
    assert llm.n_vocab() == SHAPES[key[0]].vocab_size
    assert np.isfinite(logits).all() and 0.3 < logits.std() < 5


@pytest.mark.parametrize("shape", sorted(s for s, (a, _) in FAMILY_TENSORS.items() if a in SUPPORTED_ARCHITECTURES))
def test_engine_runs_the_family_shapes_it_supports(family_models, shape: str) -> None:
    """What the scale benchmarks load: the engine's loader accepts the file, every tensor accounted for."""
    model = load(family_models[shape, "q4_k"])
    assert model.args.architecture == FAMILY_TENSORS[shape][0]
    net = build_net(model, MappedExpertSource(model), n_ctx=8)
    logits = asyncio.run(net.forward([1, 2, 3, 4], logits="all"))
    assert np.isfinite(logits).all() and 0.3 < logits.std() < 5
