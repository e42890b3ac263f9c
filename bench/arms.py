"""Benchmark arms named ``BACKEND`` or ``BACKEND@KEY=VALUE``: a kernel backend, and one environment setting for
the worker process that runs it (a one-variable A/B of a switch in colibri_aio.settings)."""
from __future__ import annotations

import os


def arm_env(arm: str) -> tuple[str, dict[str, str]]:
    """(the backend of ``arm``, the environment its worker runs with: this one, plus its setting if any)."""
    backend, _, setting = arm.partition("@")
    env = dict(os.environ)
    if setting:
        key, _, value = setting.partition("=")
        env[key] = value
    return backend, env
