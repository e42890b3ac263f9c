"""Split GGUF files (gguf-split's parts): opened from the first part, bit-identical to the one-part file,
and every inconsistent set of parts refused in one line."""
from __future__ import annotations

import itertools
import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from colibri_aio.errors import ModelFormatError
from colibri_aio.gguf.model import load
from colibri_aio.gguf.split import open_header, part_name
from colibri_aio.io.modelfile import ModelFileChangedError
from colibri_aio.io.reader import ExpertReader
from colibri_aio.policy.usage import model_fingerprint

from support import engine_logits, fixture, main_in_process, oracle_ids, reference_logits, split_gguf

# (fixture, tensors per part, first part without tensors): two and three parts, and gguf-split's
# --no-tensor-first-split layout; each puts some experts' gate, up and down ranges in different parts.
LAYOUTS = [("mixtral_q8_0", 12, False), ("tiny_q8_0", 11, False), ("qwen2moe_q8_0", 12, True)]


def split(tmp_path: Path, stem: str, max_tensors: int, small_first: bool = False, name: str = "m") -> list[Path]:
    return split_gguf(fixture(f"{stem}.gguf"), tmp_path / f"{name}.gguf", max_tensors=max_tensors,
                      small_first=small_first)


def refusal(path: Path) -> str:
    """The one line ``plan`` prints for ``path`` (exit 2 asserted)."""
    status, out, err = main_in_process("plan", str(path))
    assert status == 2 and out == "", (status, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("stem, max_tensors, small_first", LAYOUTS)
def test_parts_describe_the_same_model(tmp_path: Path, stem: str, max_tensors: int, small_first: bool) -> None:
    parts = split(tmp_path, stem, max_tensors, small_first)
    whole, model = load(fixture(f"{stem}.gguf")), load(parts[0])
    assert len(parts) >= 2 and model.paths == tuple(parts)
    assert model.args == whole.args
    # each expert's bytes: the same bytes, from whichever part holds each range
    straddling = 0
    for mine, theirs in zip(itertools.chain(*model.experts), itertools.chain(*whole.experts)):
        straddling += len({r.file for r in mine.ranges}) > 1
        for a, b in zip(mine.ranges, theirs.ranges):
            got = np.fromfile(parts[a.file], np.uint8, a.nbytes, offset=a.offset)
            want = np.fromfile(whole.path, np.uint8, b.nbytes, offset=b.offset)
            assert np.array_equal(got, want) and (a.ggml_type, a.shape) == (b.ggml_type, b.shape)
    files = {r.file for loc in itertools.chain(*model.experts) for r in loc.ranges}
    assert straddling > 0 and len(files) > 1
    assert np.array_equal(model.token_embd.data, whole.token_embd.data)


@pytest.mark.parametrize("stem, max_tensors, small_first", LAYOUTS)
async def test_logits_are_bit_identical_to_the_one_part_file(tmp_path: Path, stem: str, max_tensors: int,
                                                            small_first: bool) -> None:
    parts = split(tmp_path, stem, max_tensors, small_first)
    a = load(parts[0]).args
    ids = [t % a.vocab_size for t in oracle_ids()[2]]
    want = await reference_logits(fixture(f"{stem}.gguf"), ids)  # prefill of 12, then decode one by one
    assert np.array_equal(await reference_logits(parts[0], ids), want)
    k, e = a.expert_used_count, a.expert_count
    for io, per_layer, prefetch in [("uring", 1, "on"), ("uring", e, "off"), ("pread", k, "on"), ("mmap", k, "auto"),
                                    ("uring", k + 1, "auto")]:
        got, engine = await engine_logits(parts[0], ids, io=io, cache_per_layer=per_layer, prefetch=prefetch)
        assert np.array_equal(got, want), (io, per_layer, prefetch)
        assert engine.source.reader.stats.reads > 0
    assert engine.describe().startswith(f"{parts[0].name} (+{len(parts) - 1} parts): ")


def test_llama_cpp_reads_the_parts_as_the_one_part_file(tmp_path: Path) -> None:
    """The parts are what llama.cpp itself opens as a split model (so the fixture is the real format)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    parts = split(tmp_path, "mixtral_q8_0", 12)
    ids = [t % load(parts[0], resident=False).args.vocab_size for t in oracle_ids()[0][:8]]

    def logits(path: Path) -> np.ndarray:
        llm = llama_cpp.Llama(model_path=str(path), n_threads=2, n_ctx=32, logits_all=True, verbose=False)
        try:
            llm.eval(ids)
            return np.asarray(llm.scores[: len(ids)]).copy()
        finally:
            llm.close()

    assert np.array_equal(logits(parts[0]), logits(fixture("mixtral_q8_0.gguf")))


async def test_each_range_is_read_from_its_own_part(tmp_path: Path) -> None:
    parts = split(tmp_path, "mixtral_q8_0", 12)
    model = load(parts[0], resident=False)
    locs = list(itertools.chain(*model.experts))
    in_second = next(loc for loc in locs if {r.file for r in loc.ranges} == {1})
    straddling = next(loc for loc in locs if {r.file for r in loc.ranges} == {0, 1})
    reader = await ExpertReader.open(model.paths, model.expert_nbytes_max, n_slots=2, backend="pread")
    try:
        for loc in (in_second, straddling):
            weights = await reader.start(loc, 0)
            for got, rng in zip((weights.gate, weights.up, weights.down), loc.ranges):
                assert np.array_equal(got.data, np.fromfile(parts[rng.file], np.uint8, rng.nbytes, offset=rng.offset))
        os.utime(parts[0], ns=(0, 0))  # part 1 changes under the reader: reads from it are refused, naming it
        with pytest.raises(ModelFileChangedError, match=f"^{parts[0]}: the model file changed"):
            await reader.start(straddling, 0)
        await reader.start(in_second, 1)  # reads nothing from part 1
    finally:
        await reader.aclose()


def test_plan_doctor_and_the_usage_fingerprint_know_every_part(tmp_path: Path) -> None:
    parts = split(tmp_path, "mixtral_q8_0", 12)
    status, out, _ = main_in_process("plan", str(parts[0]), "--json", "--no-history")
    doc = json.loads(out)
    assert status == 0 and doc["files"] == [str(p) for p in parts]
    assert doc["file_bytes"] == sum(p.stat().st_size for p in parts)
    status, out, err = main_in_process("doctor", str(parts[0]), "--verify")
    assert status == 0, out + err
    assert "in 2 parts" in out and "data sections of their 2 parts" in out
    trace = tmp_path / "t.jsonl"
    status, _, err = main_in_process("trace", str(parts[0]), "--prompt", "Lists are", "--max-tokens", "2",
                                     "--out", str(trace), "--no-history")
    assert status == 0, err
    assert json.loads(trace.read_text().splitlines()[0])["files"] == [str(p) for p in parts]
    # the fingerprint covers every part's header and size, and not where the parts are
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    for p in parts:
        shutil.copy(p, moved / p.name)
    fingerprint = model_fingerprint(load(parts[0], resident=False))
    assert model_fingerprint(load(moved / parts[0].name, resident=False)) == fingerprint
    assert fingerprint != model_fingerprint(load(fixture("mixtral_q8_0.gguf"), resident=False))
    three = split(tmp_path, "mixtral_q8_0", 8, name="three")
    assert fingerprint != model_fingerprint(load(three[0], resident=False))


def test_doctor_verify_names_the_part_holding_a_bad_value(tmp_path: Path) -> None:
    parts = split(tmp_path, "tiny_q8_0", 11)
    down = next(t for t in open_header(parts[0]).tensors if t.name == "blk.1.ffn_down_exps.weight")
    assert down.part == 2
    per_expert = down.n_bytes // int(down.shape[2])
    with open(parts[2], "r+b") as f:  # the f16 scale of expert 3's first Q8_0 block: NaN
        f.seek(down.data_offset + 3 * per_expert)
        f.write(struct.pack("<H", 0x7E00))
    status, out, _ = main_in_process("doctor", str(parts[0]), "--verify")
    assert status == 2
    assert (f"FAIL  values           {parts[2]}: blk.1.ffn_down_exps.weight: values that are not finite "
            f"(NaN or infinity) in expert 3") in out


def test_a_merged_file_with_split_count_zero_is_one_file(tmp_path: Path) -> None:
    """gguf-split --merge writes split.count = 0 into the merged file; split.count 1 is one part too."""
    from support import rewrite_gguf

    for count in (0, 1):
        path = rewrite_gguf(fixture("tiny_f32.gguf"), tmp_path / f"merged{count}.gguf",
                            keys={"split.no": 0, "split.count": count, "split.tensors.count": 3})
        assert open_header(path).paths == (path,)


# --- refusals: one line, exit 2 -----------------------------------------------------------------------


def test_a_later_part_is_refused_naming_the_first(tmp_path: Path) -> None:
    parts = split(tmp_path, "mixtral_q8_0", 8)
    assert refusal(parts[1]) == (f"colibri-aio: error: {parts[1]}: this is part 2 of {len(parts)}; open the model from its "
                                 f"first part ({parts[0].name}), as llama.cpp does")


def test_a_missing_part_is_refused(tmp_path: Path) -> None:
    parts = split(tmp_path, "mixtral_q8_0", 8)
    parts[2].unlink()
    line = refusal(parts[0])
    assert line == f"colibri-aio: error: {parts[0]}: part 3 of {len(parts)}, {parts[2].name}, is missing (expected in {tmp_path})"


def test_a_first_part_whose_name_does_not_say_where_the_others_are_is_refused(tmp_path: Path) -> None:
    parts = split(tmp_path, "mixtral_q8_0", 12)
    renamed = parts[0].rename(tmp_path / "model.gguf")
    assert "the first of 2 parts (split.count), but its name does not end in -00001-of-00002.gguf" in refusal(renamed)


def test_a_part_of_another_split_is_refused(tmp_path: Path) -> None:
    two, three = split(tmp_path, "mixtral_q8_0", 12, name="two"), split(tmp_path, "mixtral_q8_0", 8, name="three")
    shutil.copy(three[1], two[1])
    assert refusal(two[0]) == (f"colibri-aio: error: {two[1]}: split.count is 3 but the first part, {two[0].name}, says 2: "
                               f"a part of another split")


def test_a_part_of_another_model_is_refused(tmp_path: Path) -> None:
    mine, other = split(tmp_path, "mixtral_q8_0", 12, name="mine"), split(tmp_path, "olmoe_q8_0", 14, name="other")
    assert len(mine) == len(other) == 2
    shutil.copy(other[1], mine[1])
    line = refusal(mine[0])
    assert line.startswith(f"colibri-aio: error: {mine[1]}: split.tensors.count is ") and line.endswith(": a part of another model")


def test_parts_out_of_order_are_refused(tmp_path: Path) -> None:
    parts = split(tmp_path, "mixtral_q8_0", 8)
    swap = tmp_path / "swap"
    parts[1].rename(swap)
    parts[2].rename(parts[1])
    swap.rename(parts[2])
    assert refusal(parts[0]) == (f"colibri-aio: error: {parts[1]}: holds part 3 of 3 (split.no 2) but is named as part 2 of 3: "
                                 f"parts out of order")


def _write_parts(src: Path, dst: Path, groups: list[list[str]], *, tensors_count: int | None = None) -> list[Path]:
    """Parts of ``src`` holding the tensors named in ``groups`` (one list per part), written one by one,
    for layouts gguf-split never writes."""
    import gguf

    from support import _copy_keys

    reader = gguf.GGUFReader(src)
    by_name = {t.name: t for t in reader.tensors}
    count = len(groups)
    total = sum(map(len, groups)) if tensors_count is None else tensors_count
    paths = []
    for no, names in enumerate(groups):
        path = dst.with_name(part_name(dst.stem, no, count))
        writer = gguf.GGUFWriter(str(path), reader.fields["general.architecture"].contents())
        if no == 0:
            _copy_keys(reader, writer)
        writer.add_uint16("split.no", no)
        writer.add_uint16("split.count", count)
        writer.add_int32("split.tensors.count", total)
        for name in names:
            writer.add_tensor(name, np.asarray(by_name[name].data), raw_dtype=by_name[name].tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        paths.append(path)
    return paths


def test_a_tensor_in_two_parts_is_refused(tmp_path: Path) -> None:
    names = [t.name for t in open_header(fixture("mixtral_q8_0.gguf")).tensors]
    half = len(names) // 2
    parts = _write_parts(fixture("mixtral_q8_0.gguf"), tmp_path / "dup.gguf", [names[:half], names[half - 1:]])
    assert refusal(parts[0]) == (f"colibri-aio: error: {parts[1]}: tensor {names[half - 1]} is also in part 1, {parts[0].name}")


def test_parts_that_do_not_hold_every_tensor_are_refused(tmp_path: Path) -> None:
    names = [t.name for t in open_header(fixture("mixtral_q8_0.gguf")).tensors]
    half = len(names) // 2
    parts = _write_parts(fixture("mixtral_q8_0.gguf"), tmp_path / "short.gguf", [names[:half], names[half:-1]],
                         tensors_count=len(names))
    assert refusal(parts[0]) == (f"colibri-aio: error: {parts[0]}: the 2 parts hold {len(names) - 1} tensors, "
                                 f"split.tensors.count says {len(names)}")


def test_the_api_refuses_as_the_cli_does(tmp_path: Path) -> None:
    parts = split(tmp_path, "mixtral_q8_0", 12)
    parts[1].unlink()
    with pytest.raises(ModelFormatError, match="part 2 of 2, .* is missing"):
        load(parts[0])
