"""The built wheel holds the mapped packages: colibri_aio.io and colibri_aio.kernels, never top-level io/kernels."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    (path,) = out.glob("colibri_aio-*.whl")
    return path


def test_wheel_maps_io_and_kernels_into_the_package(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    for module in ("colibri_aio/io/reader.py", "colibri_aio/kernels/quant.py", "colibri_aio/policy/cache.py",
                   "colibri_aio/py.typed", "colibri_aio/models/__init__.py",
                   "colibri_aio/models/colibri-tiny-q8_0.gguf"):
        assert module in names
    assert not any(n.startswith(("io/", "kernels/")) for n in names)


def test_installed_wheel_imports(wheel: Path, tmp_path: Path) -> None:
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    code = ("import colibri_aio, colibri_aio.io.reader, colibri_aio.kernels.quant, colibri_aio.policy.cache, sys;"
            "assert colibri_aio.__file__.startswith(sys.argv[1]), colibri_aio.__file__;"
            "import importlib.util as u; assert u.find_spec('kernels') is None")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "site")], capture_output=True, text=True,
                       cwd=tmp_path, env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr


def test_editable_install_imports_from_the_tree() -> None:
    import colibri_aio.io
    import colibri_aio.kernels

    assert Path(colibri_aio.io.__file__).parent == ROOT / "io"
    assert Path(colibri_aio.kernels.__file__).parent == ROOT / "kernels"
