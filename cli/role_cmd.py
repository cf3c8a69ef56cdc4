"""``pdserve role --worker NAME --to prefill|decode``: switch a worker of a running cluster to the other pool in
place, keeping its weights (one ``POST /admin/role``; the cluster does the work: cluster/run/role_switch.py).

A standard-library client of the router's HTTP API, like ``pdserve scale``, whose options it shares.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from cli.scale_cmd import add_admin_client_arguments, format_membership, post_admin


def add_arguments(parser: argparse.ArgumentParser, default_api_key: str | None) -> None:
    parser.add_argument(
        "--worker", required=True, metavar="NAME", help="the worker to switch (pdserve status lists them)"
    )
    parser.add_argument("--to", required=True, choices=["prefill", "decode"], help="its new role")
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds it may take to finish or move away what it holds; past that the switch is called off and it "
        "keeps its role (default: the server's, 60)",
    )
    parser.add_argument("--wait", action="store_true", help="return only once the switch has ended")
    add_admin_client_arguments(parser, default_api_key)


def post_role(
    url: str, worker: str, to: str, drain_timeout_s: float | None, wait: bool, timeout_s: float, api_key: str | None
) -> dict[str, Any]:
    """The router's answer (the switch's record and the pools); ValueError (a message for the user) when refused."""
    body: dict[str, Any] = {"worker": worker, "to": to, "wait": wait}
    if drain_timeout_s is not None:
        body["drain_timeout_s"] = drain_timeout_s
    return post_admin(url, "/admin/role", body, timeout_s, api_key)


def format_switch(switch: dict[str, Any]) -> str:
    line = f"{switch['worker']}: {switch['from_role']} -> {switch['to']}: {switch['phase']}"
    if switch.get("drain_s") is not None:
        line += f"; drained in {switch['drain_s']:.2f} s"
    if switch.get("reconfigure_s") is not None:
        line += f"; rebuilt in {switch['reconfigure_s']:.2f} s"
    if switch.get("error"):
        line += f"; {switch['error']}"
    return line


def run(args: argparse.Namespace) -> int:
    data = post_role(args.url, args.worker, args.to, args.drain_timeout, args.wait, args.timeout, args.api_key)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print(format_switch(data["switch"]))
        print(format_membership(data))
    return 0 if data["switch"]["phase"] in ("draining", "reconfiguring", "done", "restarted") else 1
