"""Self-tests for the probe tests to run in a child: one that dies as a CPU without an instruction makes it die."""
from __future__ import annotations

import errno
import os
import signal


def die_sigill() -> str:
    os.kill(os.getpid(), signal.SIGILL)
    return "unreachable"


def fail_eperm() -> str:
    raise PermissionError(errno.EPERM, "io_uring_setup refused by a seccomp filter")


def fine() -> str:
    return "self-test passed"


class Refusal(RuntimeError):
    keep_verdict = True  # as ggml_cpu.GgmlUnavailable: it follows from the CPU and the build


def refuse_avx512() -> str:
    raise Refusal("the library was built for avx512, which this CPU lacks")
