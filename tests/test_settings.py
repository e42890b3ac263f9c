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
            settings.kernel_threads()


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
