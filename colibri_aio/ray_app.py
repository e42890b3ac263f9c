"""The Ray Serve application for ``serve run``: engine replicas behind one OpenAI-compatible gateway.

    serve run colibri_aio.ray_app:app                     # 2 replicas of the shipped model, 1 CPU each
    serve run colibri_aio.ray_app:build model=/models/m.gguf replicas=4 replica_cpus=2 max_queue=8

``build`` takes ``serve run``'s ``key=value`` arguments: ``model``,
``replicas``, ``replica_cpus``, ``max_queue``, ``api_key``, ``model_id``;
any other key is a placement option of ``Engine.open`` (``ram_budget=8G``,
``io=pread``, ``n_ctx=2048``, ...). Serve's HTTP address is the cluster's
(``serve run --address``, default 127.0.0.1:8000); the OpenAI API is under
``/v1``. ``python -m colibri_aio serve --ray`` starts the same application
on a cluster of its own.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from colibri_aio.cluster.deployments import ClusterConfig, build as _build


def build(args: Mapping[str, Any]) -> Any:
    """The application from ``serve run``'s arguments (see the module's docstring)."""
    return _build(ClusterConfig.from_args(args))


app = build({})
