"""tools/requantize_gguf.py: every matrix becomes the asked type, the routers are copied, mistakes exit 2."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T, GGUFReader

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "requantize_gguf.py"
SOURCE = ROOT / "fixtures" / "colibri-tiny-q8_0.gguf"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True)


@pytest.mark.parametrize("name, qtype", [("q4_0", T.Q4_0), ("q5_0", T.Q5_0)])
def test_matrices_take_the_type_and_routers_are_copied(tmp_path: Path, name: str, qtype: T) -> None:
    out = tmp_path / f"tiny_{name}.gguf"
    assert run(str(SOURCE), str(out), "--type", name).returncode == 0
    before = {t.name: t for t in GGUFReader(SOURCE).tensors}
    after = {t.name: t for t in GGUFReader(out).tensors}
    assert after.keys() == before.keys()
    for tensor_name, t in after.items():
        if before[tensor_name].tensor_type == T.F32:
            assert t.tensor_type == T.F32
            np.testing.assert_array_equal(t.data, before[tensor_name].data)
        else:
            assert t.tensor_type == qtype, tensor_name
    assert any("ffn_gate_inp" in n for n in after)


def test_mistakes_exit_2(tmp_path: Path) -> None:
    missing = run(str(tmp_path / "none.gguf"), str(tmp_path / "out.gguf"), "--type", "q4_0")
    assert missing.returncode == 2 and "none.gguf" in missing.stderr.splitlines()[-1]
    existing = tmp_path / "out.gguf"
    existing.write_bytes(b"keep")
    again = run(str(SOURCE), str(existing), "--type", "q4_0")
    assert again.returncode == 2 and existing.read_bytes() == b"keep"
