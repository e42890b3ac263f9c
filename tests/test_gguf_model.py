"""Loading GGUFs: metadata, the resident trunk, expert byte ranges, and refusing broken files."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from colibri_aio.errors import ModelFormatError
from colibri_aio.gguf.model import load

from support import FIXTURES, fixture, run_cli

# Each broken fixture and a phrase its one-line refusal must contain.
BAD = {
    "blocks_bad.gguf": "missing tensor blk.",
    "truncated_bad.gguf": "truncated",
    "shape_bad.gguf": "has shape",
    "arch_bad.gguf": "unsupported architecture",
    "experts_bad.gguf": "expert_used_count",
    "notgguf_bad.gguf": "not a GGUF",
    "quant_types/iq2_xxs_bad.gguf": "tensor blk.0.ffn_down_exps.weight has unsupported type IQ2_XXS",
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
    assert not isinstance(m.token_embd.data, np.memmap) and m.token_embd.data.base is None
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
    src = FIXTURES / "quant_types" / "iq2_xxs_bad.gguf"
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
