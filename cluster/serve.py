"""``pdserve serve`` and ``pdserve status``: run a cluster until Ctrl-C or SIGTERM; show a running one's pools."""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import urllib.error
import urllib.request

from cluster.config import load_config


def serve(args: argparse.Namespace) -> int:
    from cluster.launch import start_serving

    config = load_config(args.config)
    if args.host:
        config.router.host = args.host
    if args.port is not None:
        config.router.port = args.port
    if getattr(args, "router_processes", None) is not None:
        config.router.processes = args.router_processes  # validated on assignment (1..64)
    if getattr(args, "api_key", None):  # from the environment: the key need not be written in the config file
        config.router.api_key = args.api_key
    stop = threading.Event()
    handle = start_serving(config, address=args.address)

    def on_signal(*_) -> None:
        if stop.is_set():  # a second Ctrl-C: do not wait for the orderly shutdown
            _force_exit(handle, "second signal")
        stop.set()

    # installed after Ray's init, which sets handlers of its own that would abort the process on SIGTERM
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        workers = ", ".join(f"{w['name']} (pid {w.get('pid')})" for w in handle.worker_infos())
        print(f"pdserve: serving {config.served_model_name} in {config.mode} mode at {handle.base_url}/v1", flush=True)
        print(f"pdserve: workers: {workers}", flush=True)
        if handle.frontends is not None:
            pids = ", ".join(f"pid {pid}" for pid in handle.router_pids)
            print(f"pdserve: router processes: {len(handle.router_pids)} ({pids})", flush=True)
        else:
            print(f"pdserve: router: in this process (pid {os.getpid()})", flush=True)
        print("pdserve: Ctrl-C or SIGTERM to stop", flush=True)
        while not stop.wait(1.0):  # a bounded wait, so signals are handled promptly on every platform
            pass
    finally:
        print("pdserve: shutting down", flush=True)
        # the watchdog bounds everything after this point, Ray's exit handlers included (they hang when Ray's own
        # processes were killed first, as SIGTERM to the whole process group does)
        watchdog = threading.Timer(SHUTDOWN_TIMEOUT_S, _force_exit, args=(handle, "shutdown took too long"))
        watchdog.daemon = True
        watchdog.start()
        if not handle.stop(timeout_s=SHUTDOWN_TIMEOUT_S - 2.0):
            _force_exit(handle, "Ray was stopped under us")
    print("pdserve: stopped", flush=True)
    return 0


SHUTDOWN_TIMEOUT_S = 9.0  # process managers send SIGKILL after 10 s (docker stop) or more; exit before that


def _force_exit(handle, reason: str) -> None:
    """Kill the workers this process started, then leave at once (exit status 0: the stop was asked for)."""
    print(f"pdserve: {reason}; exiting now", flush=True)
    try:
        if handle.frontends is not None:
            handle.frontends.kill()
        handle.pools.kill_local_workers()
    finally:
        os._exit(0)


def status(args: argparse.Namespace) -> int:
    api_key = getattr(args, "api_key", None)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = urllib.request.Request(f"{args.url.rstrip('/')}/status", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as response:
            data = json.load(response)
    except urllib.error.HTTPError as exc:
        hint = " (pass --api-key or set PDSERVE_API_KEY)" if exc.code == 401 else ""
        raise ValueError(f"the router at {args.url} refused: HTTP {exc.code} {exc.reason}{hint}") from None
    except OSError as exc:
        raise ValueError(f"no pdserve router answers at {args.url}: {exc}") from None
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(f"mode: {data['mode']}   model: {data['model']}   in flight: {data['inflight']}   queued: {data['queue_depth']}")
    router = data.get("router") or {}
    if router.get("processes", 1) > 1:  # the numbers above are this process's; the queue bound is shared
        print(f"router process {router['index']} of {router['processes']} (pid {router['pid']}); queued in all: "
              f"{router.get('queue_depth_all', '?')}")
    header = f"{'worker':<14}{'role':<11}{'alive':<7}{'waiting':>8}{'running':>8}{'kv free':>12}{'transfers':>11}{'kv bytes':>12}"
    print(header)
    for w in data["workers"]:
        kv = f"{w.get('free_blocks', '?')}/{w.get('total_blocks', '?')}"
        print(f"{w['name']:<14}{w['role']:<11}{str(w['alive']):<7}{w.get('waiting', 0):>8}{w.get('running', 0):>8}"
              f"{kv:>12}{int(w.get('transfers_ok', 0)):>11}{int(w.get('transfer_bytes', 0)):>12}")
    return 0
