"""Routed experts repacked as they land (COLIBRI_GGML_REPACK_EXPERTS): the same bits wherever they land.

A repacked product sums in another order than the file's (~1e-7 of its
norm), so with repacking on every placement must still agree bit for bit
with every other (design invariant 1 holds within a setting), and all of
them stay within rounding of the file's layout.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from colibri_aio.gguf.model import load
from colibri_aio.settings import Settings

from support import engine_logits, fixture, oracle_ids

ggml_cpu = pytest.importorskip("colibri_aio.kernels.ggml_cpu")

# (fixture, mode): its routed experts are of a type the mode repacks
CASES = [("quant_types/tiny_mxfp4", "on"), ("gptoss_mxfp4", "on"), ("quant_types/tiny_iq4_nl", "on"),
         ("quant_types/ktiny_q2_k", "all"), ("tiny_q4_k", "all")]


def _expert_type(name: str) -> GGMLQuantizationType:
    return load(fixture(f"{name}.gguf")).experts[0][0].gate.ggml_type


@pytest.mark.parametrize(("name", "mode"), CASES)
async def test_repacked_experts_give_the_same_bits_in_every_placement(name: str, mode: str) -> None:
    if _expert_type(name) not in ggml_cpu.repack_types():
        pytest.skip(f"ggml has no repacked layout for {_expert_type(name).name} on this CPU")
    a = load(fixture(f"{name}.gguf")).args
    ids = [t % a.vocab_size for t in oracle_ids()[2]]
    packed = Settings.read(ggml_repack_experts=mode)
    want, engine = await engine_logits(fixture(f"{name}.gguf"), ids, kernels="ggml", io="mmap", settings=packed,
                                       history=False)
    assert engine.source.packing is not None and engine.source.packing.mapped
    assert engine.source.packing.nbytes > 0                      # the copies beside the mapping were made
    k, e = a.expert_used_count, a.expert_count
    for io, per_layer in itertools.product(("uring", "pread"), (1, k, e)):
        got, engine = await engine_logits(fixture(f"{name}.gguf"), ids, kernels="ggml", io=io, settings=packed,
                                          cache_per_layer=per_layer, history=False)
        assert engine.source.packing is not None and not engine.source.packing.mapped
        assert np.array_equal(got, want), (io, per_layer)
    got, _ = await engine_logits(fixture(f"{name}.gguf"), ids, kernels="ggml", io="uring", settings=packed,
                                 cache_per_layer=e, warm_start=True, history=False)
    assert np.array_equal(got, want), "warm start"
    # The file's layout: the same model within rounding, not the same bits. Compared on the per-operation
    # prefill, where each expert's rows are its own products: on a span's graphs an expert of four or more rows
    # takes the repacked GEMM, whose other summation order can move one Q8_K rounding of the next product and
    # with it a tiny model's position by ~1% (tiny_q4_k: one position of 22, measured 1.0e-2 of max|logit|).
    packed_ops, _ = await engine_logits(fixture(f"{name}.gguf"), ids, kernels="ggml", io="mmap", history=False,
                                        settings=Settings.read(ggml_repack_experts=mode, ggml_prefill="ops"))
    plain, engine = await engine_logits(fixture(f"{name}.gguf"), ids, kernels="ggml", io="mmap", history=False,
                                        settings=Settings.read(ggml_repack_experts="off", ggml_prefill="ops"))
    assert engine.source.packing is None
    np.testing.assert_allclose(packed_ops, plain, rtol=0, atol=1e-4 * float(np.abs(plain).max()))


async def test_off_and_numpy_kernels_leave_experts_in_the_files_layout() -> None:
    ids = oracle_ids()[2]
    _, engine = await engine_logits(fixture("quant_types/tiny_mxfp4.gguf"), ids, kernels="numpy", io="uring",
                                    settings=Settings.read(ggml_repack_experts="on"), history=False)
    assert engine.source.packing is None


def _random(t: GGMLQuantizationType, rows: int, cols: int, seed: int) -> np.ndarray:
    k = ggml_cpu.GgmlKernels(1, settings=Settings.read(ggml_repack_experts="off"))
    raw = k._random_matrix(int(t), t, rows, cols, np.random.default_rng(seed))
    assert raw is not None
    return raw


@pytest.mark.parametrize("t", sorted(ggml_cpu.repack_types(), key=lambda t: t.name))
def test_a_repacked_expert_multiplies_as_the_files_within_rounding(t: GGMLQuantizationType) -> None:
    from colibri_aio.kernels.qtensor import QTensor

    k = ggml_cpu.GgmlKernels(2, settings=Settings.read(ggml_repack_experts="all"))
    packer = k.expert_packer()
    assert packer is not None and packer.packs(t, 512)
    f, d = 512, 512
    file_layout = [QTensor(_random(t, *shape, seed), t, shape) for seed, shape in enumerate(((f, d), (f, d), (d, f)))]
    in_place = [QTensor(w.data.copy(), t, w.shape) for w in file_layout]
    in_place = [packer.pack(w) for w in in_place]                                     # a pool slot's way
    copied = [packer.pack(w, np.empty(w.nbytes, np.uint8)) for w in file_layout]      # the mapping's way
    assert all(w.packed for w in in_place + copied) and not any(w.packed for w in file_layout)
    assert all(np.array_equal(a.data, b.data) for a, b in zip(in_place, copied))
    assert not all(np.array_equal(a.data, b.data) for a, b in zip(copied, file_layout))

    class Expert:
        def __init__(self, ws: list) -> None:
            self.gate, self.up, self.down = ws

    x = np.random.default_rng(9).standard_normal((6, d)).astype(np.float32)
    for rows in (x[:1], x):                              # a decode row, and a prefill's rows
        plain = k.expert_ffns([Expert(file_layout)], [rows])[0]
        packed = k.expert_ffns([Expert(copied)], [rows])[0]
        np.testing.assert_allclose(packed, plain, rtol=0, atol=1e-5 * float(np.abs(plain).max()))
        # each row carries the bits it has alone, however many rows share the product
        alone = np.concatenate([k.expert_ffns([Expert(copied)], [rows[i:i + 1]])[0] for i in range(len(rows))])
        assert np.array_equal(packed, alone)
    assert packer.pack(copied[0]) is copied[0]                                         # never twice


def test_types_it_does_not_repack_are_left_alone() -> None:
    from colibri_aio.kernels.qtensor import QTensor

    packer = ggml_cpu.ExpertPacker()
    w = QTensor(_random(GGMLQuantizationType.Q8_0, 64, 256, 0), GGMLQuantizationType.Q8_0, (64, 256))
    assert not packer.packs(GGMLQuantizationType.Q8_0, 64)
    assert packer.pack(w) is w
    if GGMLQuantizationType.Q4_K in ggml_cpu.repack_types():      # repacked only when asked for (``all``)
        assert not packer.packs(GGMLQuantizationType.Q4_K, 64)


def test_a_repacked_matrix_has_no_row_blocks() -> None:
    from colibri_aio.kernels.qtensor import QTensor

    t = GGMLQuantizationType.Q4_0
    w = QTensor(_random(t, 16, 64, 0), t, (16, 64), packed=True)
    with pytest.raises(ValueError, match="no row blocks"):
        w.row_block(0, 8)


def test_an_expert_in_the_other_layout_is_refused_not_multiplied() -> None:
    from colibri_aio.kernels.ggml_graph import _check_layout
    from colibri_aio.kernels.qtensor import QTensor

    t = GGMLQuantizationType.Q4_0
    k = ggml_cpu.GgmlKernels(1, settings=Settings.read(ggml_repack_experts="on"))
    w = QTensor(_random(t, 16, 64, 0), t, (16, 64))

    class Shape:
        gate = down = k.expert_mat(w, True)

    class Expert:
        gate = up = down = w

    with pytest.raises(RuntimeError, match="another layout"):
        _check_layout([Expert()], Shape())  # type: ignore[arg-type]


def test_workers_packing_side_by_side_give_the_bytes_one_thread_gives() -> None:
    """Several threads repacking side by side while the kernels repack trunk matrices: every copy is the one a
    single thread makes, and ggml's log filter is never swapped under another thread."""
    import threading

    from colibri_aio.kernels.qtensor import QTensor

    t = GGMLQuantizationType.Q4_0
    k = ggml_cpu.GgmlKernels(1, settings=Settings.read(ggml_repack_experts="on"))
    packer = k.expert_packer()
    assert packer is not None
    mats = [QTensor(_random(t, 64, 256, seed), t, (64, 256)) for seed in range(6)]
    want = [packer.pack(w, np.empty(w.nbytes, np.uint8)).data.copy() for w in mats]
    got: list[list[np.ndarray]] = [[] for _ in range(3)]

    def work(i: int) -> None:
        for _ in range(20):
            got[i].extend(packer.pack(w, np.empty(w.nbytes, np.uint8)).data for w in mats)

    def trunk() -> None:
        for seed in range(20):
            k.resident([QTensor(_random(t, 64, 256, 100 + seed), t, (64, 256))])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)] + [threading.Thread(target=trunk)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for copies in got:
        assert len(copies) == 20 * len(mats)
        assert all(np.array_equal(c, want[j % len(mats)]) for j, c in enumerate(copies))


@pytest.mark.parametrize(("name", "mode"), CASES)
async def test_a_repacked_experts_file_gives_the_bits_of_repacking_as_they_land(name: str, mode: str, tmp_path,
                                                                                 monkeypatch) -> None:
    """``repack`` writes the experts once; an engine that finds the file reads them from it, repacked already,
    with the logits of repacking each one as it lands, in every placement."""
    from support import run_cli

    if _expert_type(name) not in ggml_cpu.repack_types():
        pytest.skip(f"ggml has no repacked layout for {_expert_type(name).name} on this CPU")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    a = load(fixture(f"{name}.gguf")).args
    ids = [t % a.vocab_size for t in oracle_ids()[2]]
    packed = Settings.read(ggml_repack_experts=mode)
    want, engine = await engine_logits(fixture(f"{name}.gguf"), ids, kernels="ggml", io="mmap", settings=packed,
                                       history=False)
    assert engine.source.packing is not None and not engine.source.packing.prepacked
    r = run_cli("repack", str(fixture(f"{name}.gguf")), *(["--all"] if mode == "all" else []))
    assert r.returncode == 0 and "repacked to" in r.stderr, r.stderr
    for io, per_layer in (("mmap", None), ("uring", 1), ("uring", a.expert_count), ("pread", a.expert_used_count)):
        got, engine = await engine_logits(fixture(f"{name}.gguf"), ids, kernels="ggml", io=io, settings=packed,
                                          cache_per_layer=per_layer, history=False)
        assert engine.source.packing is not None and engine.source.packing.prepacked, io
        assert np.array_equal(got, want), (io, per_layer)
    # The file layout's run never reads it.
    _, engine = await engine_logits(fixture(f"{name}.gguf"), ids, kernels="ggml", io="mmap",
                                    settings=Settings.read(ggml_repack_experts="off"), history=False)
    assert engine.source.packing is None
    assert "already" in run_cli("repack", str(fixture(f"{name}.gguf")),
                                *(["--all"] if mode == "all" else [])).stderr


def test_a_repacked_experts_file_is_for_one_model_file_and_one_layout(tmp_path, monkeypatch) -> None:
    import os
    import shutil

    from colibri_aio.engine import repacked_file

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model_file = tmp_path / "m.gguf"
    shutil.copyfile(fixture("quant_types/tiny_mxfp4.gguf"), model_file)
    packer = ggml_cpu.expert_packer_for("on")
    assert packer is not None
    model = load(model_file, resident=False)
    assert repacked_file.find(model, packer) is None
    paths = repacked_file.write(model, packer)
    assert repacked_file.find(model, packer) == paths and paths[0].stat().st_size == model_file.stat().st_size
    os.utime(model_file, ns=(1, 1))                        # the model file changed: its old file is not taken
    assert repacked_file.find(load(model_file, resident=False), packer) is None


def test_an_interrupted_repack_leaves_nothing_to_read(tmp_path, monkeypatch) -> None:
    from colibri_aio.engine import repacked_file

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    packer = ggml_cpu.expert_packer_for("on")
    model = load(fixture("quant_types/tiny_mxfp4.gguf"), resident=False)

    def stop(done: int, total: int) -> None:
        if done == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        repacked_file.write(model, packer, stop)
    assert repacked_file.find(model, packer) is None
    assert list((tmp_path / "colibri_aio" / "repacked").iterdir()) == []


def test_repack_refuses_a_model_whose_experts_it_would_not_repack() -> None:
    from support import run_cli

    r = run_cli("repack", str(fixture("tiny_q8_0.gguf")))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "no routed expert" in r.stderr


async def test_by_default_experts_are_read_repacked_only_from_a_repack_file(tmp_path, monkeypatch) -> None:
    """``auto`` (the default) repacks nothing as it lands: the file's layout, until ``repack`` has written a file
    for the model; then the experts are read from it, with the logits of ``on``."""
    from support import run_cli

    name = "quant_types/tiny_mxfp4"
    if _expert_type(name) not in ggml_cpu.repack_types():
        pytest.skip("ggml has no repacked layout for MXFP4 on this CPU")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    a = load(fixture(f"{name}.gguf")).args
    ids = [t % a.vocab_size for t in oracle_ids()[2]]
    default = Settings.read(environ={})
    assert default.get("ggml_repack_experts") == "auto"
    plain, engine = await engine_logits(fixture(f"{name}.gguf"), ids, kernels="ggml", io="uring", settings=default,
                                        history=False)
    assert engine.source.packing is None
    assert run_cli("repack", str(fixture(f"{name}.gguf"))).returncode == 0
    got, engine = await engine_logits(fixture(f"{name}.gguf"), ids, kernels="ggml", io="uring", settings=default,
                                      history=False)
    assert engine.source.packing is not None and engine.source.packing.prepacked
    assert "read repacked" in engine.describe()
    want, _ = await engine_logits(fixture(f"{name}.gguf"), ids, kernels="ggml", io="mmap",
                                  settings=Settings.read(ggml_repack_experts="on"), history=False)
    assert np.array_equal(got, want)
    off, engine = await engine_logits(fixture(f"{name}.gguf"), ids, kernels="ggml", io="uring",
                                      settings=Settings.read(ggml_repack_experts="off"), history=False)
    assert engine.source.packing is None and np.array_equal(off, plain)
