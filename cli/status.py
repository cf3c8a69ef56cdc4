"""``pdserve status``: one HTTP GET of a running router's ``/status``, printed as a table (or the JSON).

A standard-library client (it starts at once without torch or Ray) of any router serving this ``/status`` shape
(``cluster/routing/router.py``, ``status()``); ``kv`` and ``pools`` may be absent.
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from typing import Any

WORKER_HEADER = (
    f"{'worker':<14}{'role':<11}{'alive':<7}{'waiting':>8}{'running':>8}{'kv free':>12}{'transfers':>11}"
    f"{'kv bytes':>12}"
)


def add_arguments(parser: argparse.ArgumentParser, default_api_key: str | None) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the router's answer")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--api-key", default=default_api_key, help="the router's API key (default: $PDSERVE_API_KEY)")


def call_router(url: str, request: urllib.request.Request, timeout_s: float) -> dict[str, Any]:
    """A running router's JSON answer; ValueError (a message for the user, with the router's own when sent)."""
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            data: dict[str, Any] = json.load(response)
    except urllib.error.HTTPError as exc:
        try:
            message = json.load(exc)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = exc.reason
        hint = " (pass --api-key or set PDSERVE_API_KEY)" if exc.code == 401 else ""
        raise ValueError(f"the router at {url} refused: HTTP {exc.code}: {message}{hint}") from None
    except OSError as exc:
        raise ValueError(f"no pdserve router answers at {url}: {exc}") from None
    return data


def fetch_status(url: str, timeout_s: float, api_key: str | None) -> dict[str, Any]:
    """The router's ``/status`` as a dict; ValueError (a message for the user) when it cannot be had."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return call_router(url, urllib.request.Request(f"{url.rstrip('/')}/status", headers=headers), timeout_s)


def format_status(data: dict[str, Any]) -> str:
    """The table ``pdserve status`` prints: the router's totals, then one line per worker."""
    lines = [
        f"mode: {data['mode']}   model: {data['model']}   in flight: {data['inflight']}   queued: {data['queue_depth']}"
    ]
    router = data.get("router") or {}
    if router.get("processes", 1) > 1:  # the numbers above are this process's; the queue bound is shared
        lines.append(
            f"router process {router['index']} of {router['processes']} (pid {router['pid']}); queued in "
            f"all: {router.get('queue_depth_all', '?')}"
        )
    kv = data.get("kv")
    if kv:
        pools = "; ".join(
            f"{name} {p['blocks']} blocks = {p['tokens']:,} tokens per replica" for name, p in kv["pools"].items()
        )
        lines.append(
            f"kv: {kv['bytes_per_token']:,} B/token ({kv['dtype']}), {kv['tokens_per_gib']:,} tokens/GiB, "
            f"blocks of {kv['block_size']}; {pools}"
        )
    for name, pool in (data.get("pools") or {}).items():
        draining = f", draining: {', '.join(pool['draining'])}" if pool.get("draining") else ""
        lines.append(f"pool {name}: {pool['replicas']} replicas{draining}")
    lines.append(WORKER_HEADER)
    for w in data["workers"]:
        kv = f"{w.get('free_blocks', '?')}/{w.get('total_blocks', '?')}"
        lines.append(
            f"{w['name']:<14}{w['role']:<11}{str(w['alive']):<7}{w.get('waiting', 0):>8}"
            f"{w.get('running', 0):>8}{kv:>12}{int(w.get('transfers_ok', 0)):>11}"
            f"{int(w.get('transfer_bytes', 0)):>12}" + _state(w)
        )
    return "\n".join(lines)


def _state(worker: dict[str, Any]) -> str:
    """A worker's line's tail: a role switch under way and its phase, or a plain drain."""
    switch = worker.get("switch")
    if switch:
        return f"  switching to {switch['to']}: {switch['phase']} ({switch['elapsed_s']:.1f} s)"
    return "  draining" if worker.get("state") == "draining" else ""


def status(args: argparse.Namespace) -> int:
    data = fetch_status(args.url, args.timeout, getattr(args, "api_key", None))
    print(json.dumps(data, indent=2) if args.json else format_status(data))
    return 0
