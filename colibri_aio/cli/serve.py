"""``serve``: the command-line side of the HTTP server (:mod:`colibri_aio.serve.server`) and of its replicas on
Ray Serve (:mod:`colibri_aio.cluster.launch`)."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from colibri_aio import settings
from colibri_aio.cli.options import add_model, add_placement, model_path, placement_options
from colibri_aio.errors import UserError
from colibri_aio.policy.budget import parse_size


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Declare ``serve`` and its options."""
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (chat, completions, SSE streams, /metrics)",
                       description="Serve a model over HTTP with OpenAI's API: /v1/chat/completions, /v1/completions "
                                   "(streamed with SSE or not), /v1/models, /health, /metrics (Prometheus), "
                                   "/tokenize, /detokenize, /slots/{id}?action=save|restore. --parallel generations decode "
                                   "together; others wait in a bounded queue (429 beyond it). The KV cache is reused across requests that share a "
                                   "prefix. Sampling defaults come from the model's general.sampling.* keys, else "
                                   "llama.cpp's.")
    add_model(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s, this machine only)")
    p.add_argument("--port", type=int, default=8080, help="TCP port; 0 picks a free one (default: %(default)s)")
    p.add_argument("--api-key", default=settings.given("api_key"), metavar="KEY",
                   help="require Authorization: Bearer KEY (default: $COLIBRI_API_KEY; unset: any key or none, "
                        "and only this machine's Host names are answered, see --allowed-hosts; empty: refused)")
    p.add_argument("--max-queue", type=int, default=16, metavar="N",
                   help="requests that may wait while one generates; more get 429 (default: %(default)s)")
    p.add_argument("--slot-save-path", type=Path, default=None, metavar="DIR",
                   help="the folder POST /slots/{id}?action=save|restore keeps slot files in (a slot's KV cache and "
                        "token ids; default: off)")
    p.add_argument("--alias", default=None, metavar="NAME", help="model id to report (default: the file name)")
    g = p.add_argument_group("request limits (not with --ray yet)")
    g.add_argument("--max-body", default=None, metavar="SIZE",
                   help="largest request body, e.g. 16M or 512K; larger gets 413 (default: 16M)")
    g.add_argument("--read-timeout", type=float, default=None, metavar="S",
                   help="seconds a request's headers, and then its body, may take to arrive; a slower client is cut "
                        "off (default: 30)")
    g.add_argument("--max-connections", type=int, default=None, metavar="N",
                   help="open connections at once; past them a request gets 503 (default: 256)")
    g.add_argument("--allowed-hosts", action="append", default=None, metavar="NAME[,NAME]",
                   help="Host names answered when no API key is set, besides IP addresses, localhost and the --host "
                        "name (against DNS rebinding: a page elsewhere whose name points here); '*': any")
    p.add_argument("--reasoning-budget", type=int, default=-1, metavar="N",
                   help="thinking tokens a reply may spend before its thinking span is closed (a request's "
                        "reasoning_budget overrides it; 0: answer at once; default: -1, no limit)")
    g = p.add_argument_group("replicas on Ray Serve (pip install 'colibri-aio[ray]')")
    g.add_argument("--ray", action="store_true",
                   help="serve replicas of the engine on Ray Serve behind this endpoint: a chat's next turn goes "
                        "to the replica holding its KV cache; --max-queue is per replica")
    g.add_argument("--replicas", type=int, default=None, metavar="N", help="engine replicas (default: 2)")
    g.add_argument("--replica-cpus", type=float, default=None, metavar="C",
                   help="CPUs Ray reserves for each replica, and its kernel threads (default: 1)")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="deploy to this Ray cluster (default: start one on this machine, on 127.0.0.1)")
    add_placement(p)
    p.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    """Serve until stopped, on this machine or on Ray Serve with --ray; the exit status."""
    if args.api_key == "":
        raise UserError("the API key is empty (--api-key or COLIBRI_API_KEY): give a key, or none for no key")
    limits = {"--max-body": args.max_body, "--read-timeout": args.read_timeout,
              "--max-connections": args.max_connections, "--allowed-hosts": args.allowed_hosts}
    if args.ray:
        if (flag := next((f for f, v in limits.items() if v is not None), None)) is not None:
            raise UserError(f"{flag} does not apply to --ray yet (the gateway has its own front)")
        from colibri_aio.cluster.launch import serve_on_ray

        return serve_on_ray(model_path(args), host=args.host, port=args.port, api_key=args.api_key,
                            max_queue=args.max_queue, model_id=args.alias,
                            replicas=2 if args.replicas is None else args.replicas,
                            replica_cpus=1.0 if args.replica_cpus is None else args.replica_cpus,
                            address=args.ray_address, open_options=placement_options(args))
    # Their defaults are None rather than 2 and 1 so that giving one without --ray can be told apart.
    given = [o for o, v in (("--replicas", args.replicas), ("--replica-cpus", args.replica_cpus),
                            ("--ray-address", args.ray_address)) if v is not None]
    if given:
        raise UserError(f"{given[0]} needs --ray")
    from colibri_aio.serve.server import serve

    return serve(model_path(args), host=args.host, port=args.port, api_key=args.api_key, max_queue=args.max_queue,
                 model_id=args.alias, open_options=placement_options(args), slot_save_path=args.slot_save_path,
                 reasoning_budget=args.reasoning_budget, **_limit_options(args))


def _limit_options(args: argparse.Namespace) -> dict[str, Any]:
    """serve()'s keywords of the request limits given (the others keep serve()'s defaults)."""
    options: dict[str, Any] = {}
    if args.max_body is not None:
        try:
            options["max_body"] = parse_size(args.max_body)
        except UserError as exc:
            raise UserError(f"--max-body: {exc}") from None
    if args.read_timeout is not None:
        options["read_timeout"] = args.read_timeout
    if args.max_connections is not None:
        options["max_connections"] = args.max_connections
    if args.allowed_hosts is not None:
        options["allowed_hosts"] = [h.strip() for arg in args.allowed_hosts for h in arg.split(",") if h.strip()]
    return options
