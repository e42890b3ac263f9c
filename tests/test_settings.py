"""The environment is read in one module, typed and validated; every other module asks it."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from colibri_aio import settings
from colibri_aio.errors import UserError
from colibri_aio.kernels import threads

ROOT = Path(__file__).resolve().parent.parent


def test_no_module_but_settings_reads_the_environment() -> None:
    reads = re.compile(r"os\.environ|os\.getenv|getenv\(|environ\.get")
    offenders = [f"{path.relative_to(ROOT)}:{n}" for folder in ("colibri_aio", "io", "kernels")
                 for path in sorted((ROOT / folder).rglob("*.py")) if path.name != "settings.py"
                 for n, line in enumerate(path.read_text().splitlines(), 1) if reads.search(line)]
    assert offenders == []


@pytest.mark.parametrize("name", [n for n, s in settings.SWITCHES.items() if s.choices])
def test_a_value_outside_the_choices_is_a_user_error_naming_the_variable(name: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    switch = settings.SWITCHES[name]
    monkeypatch.setenv(switch.variable, "bogus")
    with pytest.raises(UserError, match=f"^{switch.variable}='bogus': choose one of {switch.choices[0]}"):
        settings.get(name)
    monkeypatch.setenv(switch.variable, "")  # empty is unset
    assert settings.get(name) == switch.default == switch.choices[0]


def test_kernel_threads_are_read_when_first_asked_for_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads, "_num_threads", None)
    monkeypatch.setattr(threads, "_pool", None)
    monkeypatch.setenv("COLIBRI_KERNEL_THREADS", "3")
    assert threads.get_num_threads() == 3
    monkeypatch.setattr(threads, "_num_threads", None)
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("COLIBRI_KERNEL_THREADS", bad)
        with pytest.raises(UserError, match="COLIBRI_KERNEL_THREADS"):
            threads.get_num_threads()
        with pytest.raises(UserError, match="COLIBRI_KERNEL_THREADS"):
            settings.Settings.read()


def test_settings_are_read_once_every_switch_checked_and_the_callers_values_win(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLIBRI_GGML_STEP", "layers")
    read = settings.Settings.read()
    monkeypatch.setenv("COLIBRI_GGML_STEP", "graph")          # read once: a later change is not heard
    assert read.get("ggml_step") == "layers" and read.kernel_threads >= 1
    assert settings.Settings.read(ggml_step="layers", kernels=None).get("ggml_step") == "layers"
    assert settings.Settings.read(environ={}).get("ggml_step") == "graph"        # the default
    monkeypatch.setenv("COLIBRI_GGML_REPACK", "maybe")       # any switch out of its choices refuses the read
    with pytest.raises(UserError, match="COLIBRI_GGML_REPACK='maybe'"):
        settings.Settings.read()
    with pytest.raises(ValueError, match="unknown settings"):
        settings.Settings.read(environ={}, ggml_stpe="layers")


async def test_an_engine_hands_its_settings_to_what_it_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The settings an engine was opened with reach its kernels and its net, whatever the environment says
    after (or instead)."""
    from colibri_aio import Engine
    from support import fixture

    chosen = settings.Settings.read(environ={}, ggml_graphs="off", ggml_repack="off")
    monkeypatch.setenv("COLIBRI_GGML_GRAPHS", "on")
    async with await Engine.open(fixture("tiny_q4_0.gguf"), kernels="ggml", io="pread", settings=chosen) as engine:
        assert engine.net.settings is chosen and engine.net.decode_graphs() is None
        assert engine.kernels.settings is chosen and not engine.kernels.repack
        assert engine.net.repacked_nbytes == 0


def test_the_cache_home_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from colibri_aio.cachefiles import cache_dir
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir("probes") == tmp_path / "colibri_aio" / "probes"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == Path.home() / ".cache" / "colibri_aio"


def test_every_switch_is_described() -> None:
    lines = settings.describe()
    assert len(lines) == len(settings.SWITCHES)
    assert all(line.split()[0].startswith(("COLIBRI_", "XDG_")) for line in lines)


def test_the_readme_lists_every_variable() -> None:
    readme = (ROOT / "README.md").read_text()
    assert [s.variable for s in settings.SWITCHES.values() if f"| `{s.variable}` |" not in readme] == []
