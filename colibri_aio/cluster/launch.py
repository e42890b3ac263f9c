"""``python -m colibri_aio serve --ray``: engine replicas on Ray Serve behind one OpenAI-compatible endpoint.

Without ``--ray-address`` it starts a Ray cluster on this machine (on
127.0.0.1, with this machine's CPUs) and stops it on the way out; with one,
it deploys to that cluster (every node needs colibri-aio and the model file at
the same path) and removes only its own application when it stops. It
serves until SIGINT or SIGTERM and exits 130 or 143, like ``serve``.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

from colibri_aio.errors import UserError
from colibri_aio.serve.server import bind, url_of

OBJECT_STORE_BYTES = 128 * 2**20  # requests and stream chunks are small; Ray's default takes 30% of RAM


def import_ray() -> tuple[ModuleType, ModuleType]:
    """``ray`` and ``ray.serve``, or a user error saying how to install them."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise UserError("serve --ray needs Ray Serve: pip install 'colibri-aio[ray]'") from None
    return ray, serve


def serve_on_ray(model: Path | None, *, host: str, port: int, api_key: str | None, max_queue: int,
                 model_id: str | None, replicas: int, replica_cpus: float, address: str | None,
                 open_options: dict[str, Any]) -> int:
    """Deploy the replicas and the gateway, print where they serve, and serve until a signal."""
    ray, serve = import_ray()
    from colibri_aio.cluster.deployments import APP_NAME, LOGGING, ClusterConfig, build
    from colibri_aio.gguf.model import load
    from colibri_aio.models import default_model_path

    options = {k: v for k, v in open_options.items() if k != "progress"}  # no terminal in a replica
    config = ClusterConfig(model=None if model is None else str(model.resolve()), replicas=replicas,
                           replica_cpus=replica_cpus, max_queue=max_queue, api_key=api_key, model_id=model_id,
                           open_options=options, host=host)
    path = model if model is not None else default_model_path()
    load(path, resident=False)  # a missing or broken model is one line now, not a failed deployment later
    with bind(host, port) as probe:  # the address is free and ours to take; port 0: the kernel picks one
        url = url_of(probe)
        port = probe.getsockname()[1]
    own_cluster = address is None
    if own_cluster:  # known before Ray starts (10-30 s on two cores): say it now
        _check_cpus(config, os.cpu_count() or 1)
    sigterm = signal.getsignal(signal.SIGTERM)
    ray.init(address="local" if own_cluster else address, include_dashboard=False, logging_level=logging.WARNING,
             **(dict(num_cpus=os.cpu_count(), object_store_memory=OBJECT_STORE_BYTES,
                     _node_ip_address="127.0.0.1") if own_cluster else {}))
    _restore(signal.SIGTERM, sigterm)  # ray.init installs its own; the CLI's stops us as Ctrl-C does
    try:
        _check_cpus(config, ray.cluster_resources().get("CPU", 0))
        serve.start(http_options={"host": host, "port": port}, logging_config=LOGGING)
        try:
            serve.run(build(config), name=APP_NAME, route_prefix="/")
        except RuntimeError as exc:
            raise UserError(f"the replicas did not start: {_reason(exc)}") from None
        name = model_id or path.name
        print(f"[{replicas} replica(s) of {path.name} on Ray ({'a local cluster' if own_cluster else address}), "
              f"{replica_cpus:g} CPU(s) each]", file=sys.stderr)
        print(f"[serving {name} at {url}/v1 ({replicas} replica(s), each one stream at a time with {max_queue} "
              f"waiting{'; API key required' if api_key else ''}); Ctrl-C stops]", file=sys.stderr, flush=True)
        threading.Event().wait()  # until SIGINT (KeyboardInterrupt) or SIGTERM (the CLI's Terminated)
    finally:
        _stop(ray, serve, APP_NAME, own_cluster)
    return 0


def _restore(signum: int, handler: Any) -> None:
    if handler is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signum, handler)


def _check_cpus(config: Any, have: float) -> None:
    """A user error unless the cluster's ``have`` CPUs hold every replica's share."""
    need = config.replicas * config.replica_cpus
    if need > have:
        raise UserError(f"{config.replicas} replica(s) x {config.replica_cpus:g} CPU(s) need {need:g} CPUs; the "
                        f"Ray cluster has {have:g} (fewer --replicas or a smaller --replica-cpus)")


def _reason(exc: BaseException) -> str:
    """The line of a deployment failure that names the replica's error (a UserError's message when it was one)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for marker in ("UserError: ", "ModelFormatError: ", "Error: "):
        for line in reversed(lines):
            if marker in line:
                return line.split(marker, 1)[1]
    return lines[-1] if lines else exc.__class__.__name__


def _stop(ray: ModuleType, serve: ModuleType, app: str, own_cluster: bool) -> None:
    """Stop serving: the whole cluster if we started it, else only our application; a second Ctrl-C or
    SIGTERM meanwhile is ignored, so the shutdown is never cut short."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in handlers:
        _restore(s, signal.SIG_IGN)
    try:
        if own_cluster:
            serve.shutdown()
            ray.shutdown()
        else:
            serve.delete(app)
    finally:
        for s, handler in handlers.items():
            _restore(s, handler)
