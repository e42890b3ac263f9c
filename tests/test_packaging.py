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
                   "colibri_aio/bench/iobench.py", "colibri_aio/bench/receipt.py",
                   "colibri_aio/py.typed", "colibri_aio/models/__init__.py",
                   "colibri_aio/models/colibri-tiny-q8_0.gguf"):
        assert module in names
    assert not any(n.startswith(("io/", "kernels/", "bench/")) for n in names)


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


def test_source_tree_mapping_is_pyproject_mapping() -> None:
    import tomllib

    from colibri_aio._source_tree import MAPPED

    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert {k: v for k, v in dirs.items() if k != "colibri_aio"} == MAPPED


@pytest.fixture(scope="module")
def fresh_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new virtual environment with the wheel installed (not editable), no network: the dependencies
    come from the site-packages folders this interpreter already uses, through a .pth file."""
    venv = tmp_path_factory.mktemp("venv") / "v"
    r = subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    python = venv / "bin" / "python"
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                        "--no-index", str(wheel)], capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and "--python" in r.stderr:
        pytest.skip(f"this pip cannot install into another environment: {r.stderr.strip()[:200]}")
    assert r.returncode == 0, r.stderr
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True).stdout.strip()
    deps = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    (Path(site) / "deps-from-test.pth").write_text("\n".join(deps) + "\n")
    return python


def test_installed_wheel_runs_from_the_clone_root(fresh_venv: Path, tmp_path: Path) -> None:
    """`pip install .` then `python -m colibri_aio run` at the root of the clone: the clone's colibri_aio/
    comes first on sys.path (it has no io/ inside) and must still find its I/O layer and kernels."""
    env = {"PATH": "/usr/bin:/bin", "XDG_CACHE_HOME": str(tmp_path), "HOME": str(tmp_path)}
    where = subprocess.run([str(fresh_venv), "-c", "import colibri_aio, colibri_aio.io; "
                            "print(colibri_aio.__file__); print(colibri_aio.io.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, env=env)
    assert where.returncode == 0, where.stderr
    assert all("site-packages" in line for line in where.stdout.split())   # elsewhere: the installed wheel
    r = subprocess.run([str(fresh_venv), "-m", "colibri_aio", "run", "--max-tokens", "3", "--kernels", "numpy"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and "decode 3 tok" in r.stderr
