"""doctor --verify's layout and special-token checks: where the engine's byte ranges lie in the file."""
from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest

from colibri_aio.gguf.header import HeaderField
from colibri_aio.gguf.model import Model, load
from colibri_aio.gguf.verify import layout_problems, special_token_problems

from support import FIXTURES, main_in_process

SOURCE = FIXTURES / "tiny_q8_0.gguf"


@pytest.fixture(scope="module")
def model() -> Model:
    return load(SOURCE, resident=False)


def moved(model: Model, layer: int, expert: int, proj: str, offset: int) -> list:
    """The model's expert table with one range moved to ``offset``."""
    experts = [list(row) for row in model.experts]
    loc = experts[layer][expert]
    rng = dataclasses.replace(getattr(loc, proj), offset=offset)
    experts[layer][expert] = dataclasses.replace(loc, **{proj: rng})
    return experts


def test_a_good_file_has_no_problems(model: Model) -> None:
    size = SOURCE.stat().st_size
    assert layout_problems(model.reader, model.experts, [size]) == []
    assert special_token_problems(model.reader) == []


def test_expert_ranges_reaching_into_the_header_are_found(model: Model) -> None:
    start = model.reader.parts[0].data_offset
    problems = layout_problems(model.reader, moved(model, 1, 0, "up", start - 64), [SOURCE.stat().st_size])
    assert problems == [f"{SOURCE}: layer 1 up experts at bytes [{start - 64}, "
                        f"{model.experts[1][-1].up.offset + model.experts[1][-1].up.nbytes}) reach into the header "
                        f"and metadata (which end at {start})"]


def test_overlapping_and_stray_expert_ranges_are_found(model: Model) -> None:
    size = SOURCE.stat().st_size
    e0 = model.experts[0][0].down
    overlap = layout_problems(model.reader, moved(model, 0, 1, "down", e0.offset + e0.nbytes // 2), [size])
    assert len(overlap) == 1 and overlap[0].endswith("experts 0 and 1 overlap")
    last = model.experts[0][-1].gate
    beyond = layout_problems(model.reader, moved(model, 0, len(model.experts[0]) - 1, "gate", last.offset + 4096), [size])
    assert any("gate experts" in p and "are not inside one stacked tensor" in p for p in beyond)


def test_tensors_outside_the_file_or_over_each_other_are_found(model: Model) -> None:
    size = SOURCE.stat().st_size
    last = model.reader.tensors[-1]
    short = layout_problems(model.reader, model.experts, [size - 1])
    assert any(f"tensor {last.name} at bytes" in p and "outside the data section" in p for p in short)
    header = copy.copy(model.reader)
    a, b = header.tensors[0], header.tensors[1]
    header.tensors = [a, dataclasses.replace(b, data_offset=a.data_offset + 1), *header.tensors[2:]]
    assert f"{SOURCE}: tensors {a.name} and {b.name} overlap" in layout_problems(header, model.experts, [size])


def test_special_token_ids_outside_the_vocabulary_are_found(model: Model) -> None:
    header = copy.copy(model.reader)
    header.fields = {**header.fields, "tokenizer.ggml.bos_token_id": HeaderField("tokenizer.ggml.bos_token_id", 2048, 4),
                     "tokenizer.ggml.eot_token_id": HeaderField("tokenizer.ggml.eot_token_id", 7, 4)}
    assert special_token_problems(header) == [
        f"{SOURCE}: tokenizer.ggml.bos_token_id = 2048 is not a token id (the vocabulary has 2048): ignored, "
        f"as llama.cpp ignores it"]


def test_doctor_verify_reports_the_new_checks() -> None:
    status, out, _ = main_in_process("doctor", str(SOURCE), "--verify")
    assert status == 0
    lines = {line.split()[1]: line for line in out.splitlines()}
    assert lines["layout"].startswith("OK") and "lie inside the data section" in lines["layout"]
    assert "every tokenizer.ggml.*_token_id names a token" in out
    assert lines["tokenizer"].startswith("OK    tokenizer        builds: 2048 tokens")
    assert "OK    chat template    renders a two-message conversation" in out
