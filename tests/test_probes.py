"""Native backends are tried in a child first: a child that dies by a signal means a one-line fallback, not a crash."""
from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import structlog

from colibri_aio import cpu, probes
from colibri_aio.errors import UserError
from colibri_aio.io import ExpertReader
from colibri_aio.kernels.backend import open_kernels
from support import run_cli
from test_io_reader import largest, mixed_locations, read_all_and_check

TESTS = Path(__file__).resolve().parent
pytestmark = pytest.mark.no_probe_verdicts


@pytest.fixture(autouse=True)
def fresh_process_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test is a new process as far as the probes know: nothing seen, nothing warned yet."""
    monkeypatch.setattr(probes, "_seen", {})
    monkeypatch.setattr(probes, "_warned", set())
    monkeypatch.setenv("PYTHONPATH", str(TESTS))  # the children import probe_targets from here


def replace(monkeypatch: pytest.MonkeyPatch, backend: str, target: str) -> None:
    old = probes.PROBES[backend]
    monkeypatch.setitem(probes.PROBES, backend, probes.Probe(old.name, f"probe_targets:{target}", old.package,
                                                             old.kernel_bound))


def children(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Count the probes run from now on (by target)."""
    ran: list[str] = []
    real = probes.run_child

    def counting(backend: str, target: str, timeout: float = probes.PROBE_TIMEOUT_S) -> probes.Verdict:
        ran.append(target)
        return real(backend, target, timeout)

    monkeypatch.setattr(probes, "run_child", counting)
    return ran


def test_a_child_killed_by_sigill_is_a_fatal_verdict_kept_for_later_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    replace(monkeypatch, "io_uring", "die_sigill")
    ran = children(monkeypatch)
    found = probes.verdict("io_uring")
    assert (found.ok, found.fatal, found.cached) == (False, True, False)
    assert found.line().startswith("io_uring binding died with SIGILL in a probe")
    if "avx512f" not in cpu.flags():
        assert found.line().endswith("this CPU lacks AVX-512")
    monkeypatch.setattr(probes, "_seen", {})  # a later run: the verdict comes from the cache, no child
    again = probes.verdict("io_uring")
    assert (again.ok, again.fatal, again.cached, again.detail) == (False, True, True, found.detail)
    assert len(ran) == 1
    assert probes.verdict("io_uring", fresh=True).cached is False and len(ran) == 2


def test_a_passing_probe_is_kept_and_a_new_cpu_probes_again(monkeypatch: pytest.MonkeyPatch) -> None:
    replace(monkeypatch, "ggml", "fine")
    ran = children(monkeypatch)
    assert probes.verdict("ggml").detail == "self-test passed"
    monkeypatch.setattr(probes, "_seen", {})
    assert probes.verdict("ggml").cached
    assert len(ran) == 1
    # Another CPU behind the same cache folder (a shared home, an emulator): its own key, so a probe of its own;
    # and the child, which runs on the real CPU, does not prove anything for the other one.
    monkeypatch.setattr(cpu, "signature", lambda: "another-cpu")
    other = probes.verdict("ggml")
    assert len(ran) == 2 and not other.ok and not other.proven and "another CPU" in other.detail
    monkeypatch.setattr(probes, "_seen", {})
    probes.verdict("ggml")
    assert len(ran) == 3, "a verdict that proves nothing is never kept"


def test_an_ordinary_failure_is_not_kept_but_a_refusal_from_the_key_is(monkeypatch: pytest.MonkeyPatch) -> None:
    replace(monkeypatch, "io_uring", "fail_eperm")
    replace(monkeypatch, "ggml", "refuse_avx512")
    ran = children(monkeypatch)
    found = probes.verdict("io_uring")
    assert not found.ok and not found.fatal and "seccomp" in found.detail
    refused = probes.verdict("ggml")
    assert not refused.ok and refused.detail.endswith("which this CPU lacks)")
    monkeypatch.setattr(probes, "_seen", {})
    probes.verdict("io_uring")
    assert probes.verdict("ggml").cached
    assert ran == ["probe_targets:fail_eperm", "probe_targets:refuse_avx512", "probe_targets:fail_eperm"]


def test_a_damaged_verdict_is_set_aside_and_probed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    replace(monkeypatch, "io_uring", "fine")
    probes.verdict("io_uring")
    path = probes._cache_path("io_uring", probes.cache_key("io_uring"))
    path.write_text("{not json")
    monkeypatch.setattr(probes, "_seen", {})
    with structlog.testing.capture_logs() as logs:
        assert probes.verdict("io_uring").ok
    assert path.with_name(path.name + ".bad").exists()
    assert any("damaged probe verdict" in e["event"] for e in logs)


async def test_the_reader_falls_back_to_pread_with_one_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    replace(monkeypatch, "io_uring", "die_sigill")
    path = tmp_path / "experts.bin"
    path.write_bytes(np.random.default_rng(2).bytes(6 << 20))
    locs = mixed_locations(6 << 20, 12)
    with structlog.testing.capture_logs() as logs:
        for _ in range(2):  # a second reader in the same process warns no more
            reader = await ExpertReader.open(path, largest(locs), n_slots=4, backend="auto")
            try:
                assert reader.backend == "pread"
                assert "died with SIGILL" in reader.backend_reason
                await read_all_and_check(reader, path, locs)
            finally:
                await reader.aclose()
    warnings = [e["event"] for e in logs if e["log_level"] == "warning"]
    assert len(warnings) == 1 and warnings[0].startswith("io_uring binding died with SIGILL in a probe")
    assert warnings[0].endswith("; reading with pread")
    with pytest.raises(UserError, match="--io uring: the io_uring binding died with SIGILL"):
        await ExpertReader.open(path, largest(locs), n_slots=4, backend="uring")


def test_the_kernels_fall_back_to_numpy_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("ggml", reason="ggml-python is not installed")
    replace(monkeypatch, "ggml", "die_sigill")
    with structlog.testing.capture_logs() as logs:
        kernels = open_kernels("auto")
    assert kernels.name == "numpy" and "ggml library died with SIGILL" in kernels.reason
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == [
        f"ggml library {probes.verdict('ggml').detail}; computing with the NumPy kernels"]
    from colibri_aio.kernels.backend import KernelsUnavailable
    with pytest.raises(KernelsUnavailable, match="SIGILL"):
        open_kernels("ggml")


def seed_fatal_verdicts(cache_home: Path) -> None:
    """What the cache holds after both probes died on this machine: the run itself starts no child."""
    for backend in probes.PROBES:
        key = probes.cache_key(backend)
        path = probes._cache_path(backend, key)
        assert path.is_relative_to(cache_home)
        path.parent.mkdir(parents=True, exist_ok=True)
        detail = f"died with {signal.Signals.SIGILL.name} in a probe: this CPU lacks AVX-512"
        path.write_text(json.dumps(
            {"key": key, "backend": backend, "ok": False, "detail": detail, "fatal": True}))


def test_run_goes_on_with_pread_and_numpy_saying_so_in_one_line_each(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    seed_fatal_verdicts(tmp_path)
    # A cache smaller than the experts: they go to a pool, read by io_uring where it works (where every expert
    # fits, auto keeps them in the page cache and asks nothing of io_uring).
    done = run_cli("run", "--prompt", "The list type", "--max-tokens", "6", "--no-stats", "--cache-per-layer", "2")
    assert done.returncode == 0, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if "died with SIGILL" in ln]
    assert len(lines) == 2, done.stderr
    assert any(ln.endswith("io_uring binding died with SIGILL in a probe: this CPU lacks AVX-512; reading with pread")
               for ln in lines), lines
    assert any(ln.endswith("; computing with the NumPy kernels") for ln in lines), lines
    reference = run_cli("run", "--prompt", "The list type", "--max-tokens", "6", "--no-stats", "--io", "pread",
                        "--kernels", "numpy", "--no-history")
    assert done.stdout == reference.stdout


def test_doctor_shows_each_verdict_as_its_own_line_and_never_dies(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    done = run_cli("doctor")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("OK    cpu ")
    assert any(ln.startswith("OK    probe io_uring") for ln in lines), done.stdout
    assert any(ln.split()[1:3] == ["probe", "ggml"] for ln in lines), done.stdout


QEMU = shutil.which("qemu-x86_64")


@pytest.mark.skipif(QEMU is None or platform.machine() != "x86_64",
                    reason="qemu-user (Debian's qemu-user, which .ci/run installs) emulates an AVX2-only CPU")
def test_on_an_emulated_cpu_without_avx512_run_and_doctor_finish(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """``qemu-x86_64 -cpu Haswell``: CPUID says AVX2 and no AVX-512, whatever the host has. The engine must not
    die with SIGILL there; qemu-user has no io_uring (ENOSYS) and runs its children natively, so each backend
    says in one line why it is not used, and the text is the NumPy kernels' on pread."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    emulated = [QEMU, "-cpu", "Haswell", sys.executable, "-m", "colibri_aio"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run([*emulated, "run", "--prompt", "The list type", "--max-tokens", "4", "--no-stats",
                           "--no-history", "--cache-per-layer", "2"], capture_output=True, text=True, timeout=600,
                          env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    warnings = [ln for ln in done.stderr.splitlines() if "[warning" in ln]
    assert len(warnings) == 2 and any(w.endswith("reading with pread") for w in warnings), warnings
    assert any(w.endswith("computing with the NumPy kernels") for w in warnings), warnings
    reference = run_cli("run", "--prompt", "The list type", "--max-tokens", "4", "--no-stats", "--io", "pread",
                        "--kernels", "numpy", "--no-history")
    assert done.stdout == reference.stdout
    doctor = subprocess.run([*emulated, "doctor"], capture_output=True, text=True, timeout=600, env=env)
    assert doctor.returncode == 0, doctor.stderr[-2000:]
    assert "no AVX-512" in doctor.stdout.splitlines()[0]
