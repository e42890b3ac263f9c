"""tools/bench_roofline.py: the weights it times are finite for every type the engine runs on ggml."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ggml_cpu = pytest.importorskip("colibri_aio.kernels.ggml_cpu", reason="ggml-python is not installed")

from colibri_aio.kernels.quant import dequantize  # noqa: E402

TOOLS = Path(__file__).resolve().parent.parent / "tools"
sys.path.insert(0, str(TOOLS))
import bench_roofline  # noqa: E402

try:
    KERNELS = ggml_cpu.GgmlKernels(1)
except ggml_cpu.GgmlUnavailable as e:
    pytest.skip(str(e), allow_module_level=True)
TYPES = bench_roofline.engine_types(KERNELS)


def test_every_engine_type_is_benched() -> None:
    assert {"Q8_0", "Q4_K", "Q4_0", "Q5_0", "Q6_K", "MXFP4", "F16", "BF16"} <= set(TYPES)


@pytest.mark.parametrize("name", TYPES)
def test_weights_and_their_product_are_finite(name: str) -> None:
    w = bench_roofline.weights(name, 64, 512, np.random.default_rng(0))
    dense = dequantize(w)
    assert np.isfinite(dense).all() and np.abs(dense).max() > 0
    x = np.random.default_rng(1).standard_normal((1, 512)).astype(np.float32)
    y = KERNELS.linear(w, x)
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y[0], dense @ x[0], rtol=0.05, atol=0.05 * np.abs(dense @ x[0]).max())


def test_unknown_type_is_one_line_and_exit_2(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, str(TOOLS / "bench_roofline.py"), "--types", "Q8_0,Q9_9",
                          "--out", str(tmp_path)], capture_output=True, text=True)
    assert run.returncode == 2 and "Q9_9" in run.stderr.splitlines()[-1]
    assert not list(tmp_path.iterdir())
