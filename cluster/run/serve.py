"""``pdserve serve``: run a cluster until Ctrl-C or SIGTERM (``pdserve status`` is ``cli/status.py``)."""

from __future__ import annotations

import argparse
import os
import signal
import threading
from collections.abc import Callable

from cluster.config import ClusterConfig, load_config
from cluster.run.autoscale import CapacityModel


def serve(
    args: argparse.Namespace, capacity_model: Callable[[ClusterConfig], CapacityModel | None] | None = None
) -> int:
    """``--config``: a YAML path or a shipped config's name (``cluster.config.find_config``). ``capacity_model``:
    builds the autoscaler's model from the final config (cli/serve_cmd.py passes the planner's; this layer may not
    import it)."""
    from cluster.run.launch import start_serving

    config = load_config(args.config)
    if args.host:
        config.router.host = args.host
    if args.port is not None:
        config.router.port = args.port
    if getattr(args, "router_processes", None) is not None:
        config.router.processes = args.router_processes  # validated on assignment (1..64)
    if getattr(args, "api_key", None):  # from the environment: the key need not be written in the config file
        config.router.api_key = args.api_key
    model = capacity_model(config) if capacity_model is not None and config.autoscale.enabled else None
    stop = threading.Event()
    handle = start_serving(config, address=args.address, capacity_model=model)

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
            pids = handle.frontends.pids
            print(f"pdserve: router processes: {len(pids)} ({', '.join(f'pid {pid}' for pid in pids)})", flush=True)
        else:
            print(f"pdserve: router: in this process (pid {os.getpid()})", flush=True)
        print("pdserve: Ctrl-C or SIGTERM to stop", flush=True)
        while not stop.wait(1.0):  # a bounded wait, so signals are handled promptly on every platform
            pass
    finally:
        print("pdserve: shutting down", flush=True)
        # bounds everything from here, Ray's exit handlers included (they hang when SIGTERM to the process group
        # killed Ray's own processes first)
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
