"""``pdserve serve`` and ``pdserve status``: run a cluster until Ctrl-C or SIGTERM; show a running one's pools."""

from __future__ import annotations

import argparse
import json
import signal
import threading
import urllib.request

from cluster.config import load_config


def serve(args: argparse.Namespace) -> int:
    from cluster.launch import start_serving

    config = load_config(args.config)
    if args.host:
        config.router.host = args.host
    if args.port is not None:
        config.router.port = args.port
    stop = threading.Event()
    handle = start_serving(config, address=args.address)
    # installed after Ray's init, which sets handlers of its own that would abort the process on SIGTERM
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        workers = ", ".join(f"{w['name']} (pid {w.get('pid')})" for w in handle.worker_infos())
        print(f"pdserve: serving {config.served_model_name} in {config.mode} mode at {handle.base_url}/v1", flush=True)
        print(f"pdserve: workers: {workers}", flush=True)
        print("pdserve: Ctrl-C or SIGTERM to stop", flush=True)
        stop.wait()
    finally:
        print("pdserve: shutting down", flush=True)
        handle.stop()
    return 0


def status(args: argparse.Namespace) -> int:
    request = urllib.request.Request(f"{args.url.rstrip('/')}/status")
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as response:
            data = json.load(response)
    except OSError as exc:
        raise ValueError(f"no pdserve router answers at {args.url}: {exc}") from None
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(f"mode: {data['mode']}   model: {data['model']}   in flight: {data['inflight']}   queued: {data['queue_depth']}")
    header = f"{'worker':<14}{'role':<11}{'alive':<7}{'waiting':>8}{'running':>8}{'kv free':>12}{'transfers':>11}{'kv bytes':>12}"
    print(header)
    for w in data["workers"]:
        kv = f"{w.get('free_blocks', '?')}/{w.get('total_blocks', '?')}"
        print(f"{w['name']:<14}{w['role']:<11}{str(w['alive']):<7}{w.get('waiting', 0):>8}{w.get('running', 0):>8}"
              f"{kv:>12}{int(w.get('transfers_ok', 0)):>11}{int(w.get('transfer_bytes', 0)):>12}")
    return 0
