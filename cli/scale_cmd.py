"""``pdserve scale --pool decode --replicas N``: resize a pool of a running cluster (one ``POST /admin/scale``).

A standard-library client of the router's HTTP API, like ``pdserve status``. The cluster does the work
(cluster/run/scaling.py): new workers join without a restart, removed ones drain their requests first.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from typing import Any

from cli.status import call_router, fetch_status


def add_arguments(parser: argparse.ArgumentParser, default_api_key: str | None) -> None:
    parser.add_argument("--pool", required=True, choices=["prefill", "decode"])
    parser.add_argument("--replicas", type=int, required=True, metavar="N", help="the pool's new number of workers")
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds a removed worker may take to finish its requests; what is left then fails with an error "
        "(default: the server's, 60)",
    )
    parser.add_argument("--wait", action="store_true", help="return only once the removed workers have drained")
    add_admin_client_arguments(parser, default_api_key)


def add_admin_client_arguments(parser: argparse.ArgumentParser, default_api_key: str | None) -> None:
    """Where the router is and how to be let in: the options of every admin command (scale, role)."""
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds to wait for the answer (new workers load a model)"
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--api-key",
        default=default_api_key,
        help="the router's API key (default: $PDSERVE_API_KEY; without one, the admin token that pdserve serve wrote "
        "for --url's address, readable by its user only)",
    )


def post_scale(
    url: str, pool: str, replicas: int, drain_timeout_s: float | None, timeout_s: float, api_key: str | None
) -> dict[str, Any]:
    """The router's answer (the pools' membership); ValueError (a message for the user) when refused."""
    body: dict[str, Any] = {"pool": pool, "replicas": replicas}
    if drain_timeout_s is not None:
        body["drain_timeout_s"] = drain_timeout_s
    return post_admin(url, "/admin/scale", body, timeout_s, api_key)


def post_admin(url: str, path: str, body: dict[str, Any], timeout_s: float, api_key: str | None) -> dict[str, Any]:
    """An admin call's answer; ValueError (a message for the user) when refused."""
    from cluster.admin_token import admin_headers  # the API key, else the token file pdserve serve wrote

    headers = {"Content-Type": "application/json", **admin_headers(url, api_key)}
    request = urllib.request.Request(
        f"{url.rstrip('/')}{path}", data=json.dumps(body).encode(), headers=headers, method="POST"
    )
    return call_router(url, request, timeout_s)


def format_membership(data: dict[str, Any]) -> str:
    lines = []
    for name, pool in data["pools"].items():
        line = f"{name}: {pool['replicas']} replicas ({', '.join(pool['workers']) or 'none'})"
        if pool.get("pending"):
            line += f"; starting: {', '.join(pool['pending'])}"
        if pool.get("draining"):
            line += f"; draining: {', '.join(pool['draining'])}"
        if pool.get("switching"):
            line += f"; switching role: {', '.join(pool['switching'])}"
        lines.append(line)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.replicas < 0:
        raise ValueError(f"--replicas must be >= 0, got {args.replicas}")
    deadline = time.monotonic() + args.timeout
    data = post_scale(args.url, args.pool, args.replicas, args.drain_timeout, args.timeout, args.api_key)
    if args.wait:
        while True:
            pools = fetch_status(args.url, 5.0, args.api_key).get("pools", {})
            if not pools.get(args.pool, {}).get("draining"):
                break
            if time.monotonic() > deadline:
                raise ValueError(f"workers still draining after {args.timeout:.0f} s: {pools[args.pool]['draining']}")
            time.sleep(0.5)
    print(json.dumps(data, indent=2) if args.json else format_membership(data))
    return 0
