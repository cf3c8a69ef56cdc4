"""``pdserve bench stranger``: what a process without the cluster's keys can make a served cluster's processes hold.

A stranger on loopback (another local user, or anything that can reach the ports) attacks every socket of a served
cluster: the router's event socket, each worker's command socket and each decode worker's KV receiver. It speaks raw
ZMTP over TCP, because a libzmq socket of its own would keep the bytes in its own queue once the handshake fails:
- ``flood``: 8 connections, each a NULL-mechanism greeting, then an endless multipart message of 48 MiB frames;
- ``big_frame``: a greeting, then one frame that declares 512 MiB and streams it;
- ``routing_ids``: 40 connections, each a greeting and a READY naming an 8 MiB routing id;
- ``held``: 1,000 connections that send half a greeting and hold it;
- ``wrong_keys``: libzmq peers with keys not derived from the secret (CURVE to control sockets, a PLAIN password to
  KV sockets), which the access handler refuses and counts.
Each attack runs in a process of its own for ``--seconds`` while this process samples every cluster process's
resident memory (``VmRSS``, every 20 ms; the router runs in this process). Figures: per attack and process, the peak
above the median of the second before; the refused handshakes the workers and the router counted; whether a request
is served afterwards, and that no KV block is held. The same attacks hit a baseline process of plain ZeroMQ sockets,
without the handshake gate (``unguarded_baseline``, not in the goal), so the figures show what the gate stops. Goal:
a stranger moves no process's memory by more than 50 MB at any moment.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import os
import socket
import statistics
import struct
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from benchmarks.options import add_stranger_bench_arguments as add_arguments
from benchmarks.served_cluster import bench_config, local_ray, serving

if TYPE_CHECKING:
    from cluster.config import ClusterConfig

__all__ = ["add_arguments", "run"]

GOAL_MB = 50.0
SAMPLE_S = 0.02
ATTACKS = ("flood", "big_frame", "routing_ids", "held", "wrong_keys")
MiB = 1 << 20
UNGUARDED = "unguarded_baseline"  # the baseline's process: plain ZeroMQ sockets, not the cluster's (not in the goal)


# ---- the stranger's side (its own process) ---------------------------------------------------------------------


def _greeting(mechanism: bytes = b"NULL") -> bytes:
    """ZMTP 3.0's 64-byte greeting: signature, version 3.0, mechanism, as-server 0, filler."""
    return b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + mechanism.ljust(20, b"\x00") + b"\x00" + b"\x00" * 31


@functools.cache  # one copy per kind: hundreds of threads share it (building each took the attack's whole window)
def _ready(socket_type: bytes, routing_id_bytes: int) -> bytes:
    """A READY command (long form) naming a socket type the target takes and a routing id of the given size."""
    props = b"\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type
    props += b"\x08Identity" + struct.pack(">I", routing_id_bytes) + b"\x00" * routing_id_bytes
    body = b"\x05READY" + props
    return b"\x06" + struct.pack(">Q", len(body)) + body


def _frame_head(nbytes: int, more: bool) -> bytes:
    return bytes([0x02 | (0x01 if more else 0)]) + struct.pack(">Q", nbytes)


def _connect(host: str, port: int) -> socket.socket | None:
    try:
        sock = socket.create_connection((host, port), timeout=1.0)
    except OSError:
        return None
    sock.settimeout(2.0)
    return sock


def _write(sock: socket.socket, data: bytes | memoryview) -> bool:
    """All of `data`; False once the peer is gone or took none of it for the socket's timeout (the connection is
    then dropped: a partial write would break the framing)."""
    try:
        sock.sendall(data)
    except OSError:
        return False
    return True


def _stream(host: str, port: int, head: bytes, frame_bytes: int, frames: int, end: float) -> None:
    """A greeting (and `head`), then frames of `frame_bytes` (all but the last flagged MORE), the connection held
    until `end`; again whenever the peer drops it."""
    chunk = memoryview(b"\x00" * MiB)
    while time.monotonic() < end:
        sock = _connect(host, port)
        if sock is None:
            time.sleep(0.05)
            continue
        with sock:
            alive = _write(sock, _greeting()) and _write(sock, head)
            sent = 0
            while alive and time.monotonic() < end and sent < frames:
                alive = _write(sock, _frame_head(frame_bytes, more=sent + 1 < frames))
                for _ in range(frame_bytes // MiB):
                    if not alive or time.monotonic() >= end:
                        break
                    alive = _write(sock, chunk)
                sent += 1
            while alive and time.monotonic() < end:  # what it made the peer hold stays held while it is connected
                time.sleep(0.05)
        time.sleep(0.1)  # dropped: again, at ZeroMQ's own reconnect interval


def _wrong_keys(address: str, kv: bool, end: float) -> None:
    import zmq

    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER if kv else zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        if kv:
            sock.plain_username, sock.plain_password = b"pdserve", b"not-the-password"
        else:
            public, secret = zmq.curve_keypair()
            server, _ = zmq.curve_keypair()  # not the cluster's: the handshake fails before the socket is reached
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, server
        sock.connect(address)
        while time.monotonic() < end:
            try:
                sock.send(b"x" * 1024, zmq.NOBLOCK)
            except zmq.Again:
                pass
            time.sleep(0.05)
    finally:
        ctx.destroy(linger=0)


def attack(kind: str, targets: list[dict[str, Any]], seconds: float) -> None:
    """One attack on every target at once, for `seconds` (a thread per connection)."""
    end = time.monotonic() + seconds
    threads: list[threading.Thread] = []
    held: list[socket.socket] = []
    for target in targets:
        host, port = target["host"], target["port"]
        kind_of = b"DEALER" if target["plane"] == "kv" else b"PUSH"  # what a ROUTER, or a PULL, takes
        if kind == "flood":
            threads += [
                threading.Thread(target=_stream, args=(host, port, _ready(kind_of, 0), 48 * MiB, 1 << 30, end))
                for _ in range(8)
            ]
        elif kind == "big_frame":
            threads.append(threading.Thread(target=_stream, args=(host, port, _ready(kind_of, 0), 512 * MiB, 1, end)))
        elif kind == "routing_ids":
            threads += [
                threading.Thread(target=_stream, args=(host, port, _ready(kind_of, 8 * MiB), 0, 0, end))
                for _ in range(40)
            ]
        elif kind == "held":
            for _ in range(1000 // len(targets) + 1):
                sock = _connect(host, port)
                if sock is not None:
                    _write(sock, _greeting()[:5])
                    held.append(sock)
        elif kind == "wrong_keys":
            args = (f"tcp://{host}:{port}", target["plane"] == "kv", end)
            threads.append(threading.Thread(target=_wrong_keys, args=args))
    for t in threads:
        t.daemon = True
        t.start()
    while time.monotonic() < end:
        time.sleep(0.05)
    for t in threads:
        t.join(timeout=2.0)
    for sock in held:
        sock.close()


def unguarded(ports: Any, seconds: float) -> None:
    """The baseline: plain ZeroMQ sockets without the handshake gate (no CURVE, no ZAP; frame bounds of 64 MiB for
    control and 1 GiB for KV), in a process of their own, for `seconds`. The same attacks hit them."""
    import zmq

    ctx = zmq.Context()
    pull, router = ctx.socket(zmq.PULL), ctx.socket(zmq.ROUTER)
    pull.setsockopt(zmq.MAXMSGSIZE, 64 * MiB + 64)
    router.setsockopt(zmq.MAXMSGSIZE, 1 << 30)
    ports.put((pull.bind_to_random_port("tcp://127.0.0.1"), router.bind_to_random_port("tcp://127.0.0.1")))
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    poller.register(router, zmq.POLLIN)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for sock, _ in poller.poll(100):
            sock.recv_multipart()  # a whole message is read (and dropped) as a receiver would, before any check
    ctx.destroy(linger=0)


# ---- the measuring side ----------------------------------------------------------------------------------------


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


class Sampler:
    """Every process's resident memory every ``SAMPLE_S``, in a thread, from ``start`` to ``stop``."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.samples: dict[str, list[float]] = {name: [] for name in pids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, pid in self.pids.items():
                value = rss_mb(pid)
                if value is not None:
                    self.samples[name].append(value)
            self._stop.wait(SAMPLE_S)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)


def _targets(handle: Any) -> list[dict[str, Any]]:
    """Every socket a stranger on loopback can reach: (plane, owner, host, port)."""
    from urllib.parse import urlsplit

    from worker.messages import split_kv_address
    from worker.protocol import zmq_endpoint

    def entry(plane: str, owner: str, address: str) -> dict[str, Any]:
        parts = urlsplit(zmq_endpoint(address).removeprefix("shm+"))
        return {"plane": plane, "owner": owner, "host": parts.hostname, "port": parts.port}

    out = [entry("control", "router", handle.router.event_address)]
    for info in handle.worker_infos():
        out.append(entry("control", info["name"], info["command_address"]))
        for rank_address in split_kv_address(info["kv_address"]).ranks if info.get("kv_address") else []:
            out.append(entry("kv", info["name"], rank_address))
    return out


def _refused(handle: Any) -> dict[str, int]:
    """Handshakes refused so far: each worker's command socket and KV receiver, and the router's event socket."""
    import httpx

    status = httpx.get(f"{handle.base_url}/status", headers=handle.admin_headers, timeout=10).json()
    out = {}
    for worker in status["workers"]:
        out[worker["name"]] = int(worker.get("handshake_refused", 0)) + int(worker.get("kv_handshake_refused", 0))
    metrics = httpx.get(f"{handle.base_url}/metrics", timeout=10).text
    out["router"] = int(
        sum(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("pdserve_control_rejected_total") and 'reason="handshake"' in line
        )
    )
    return out


def _serves(handle: Any, config: ClusterConfig) -> bool:
    import httpx

    body = {"model": config.served_model_name, "prompt": "The stranger left and", "max_tokens": 4, "temperature": 0}
    response = httpx.post(f"{handle.base_url}/v1/completions", json=body, timeout=120)
    return response.status_code == 200 and bool(response.json()["choices"][0]["text"] is not None)


def _kv_free(handle: Any, timeout_s: float = 30.0) -> bool:
    """Every worker's blocks free and no request in flight (the attacks made no request hold anything)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = httpx.get(f"{handle.base_url}/status", headers=handle.admin_headers, timeout=10).json()
        if status["inflight"] == 0 and all(w.get("free_blocks") == w.get("total_blocks") for w in status["workers"]):
            return True
        time.sleep(0.2)
    return False


def run(args: argparse.Namespace) -> dict[str, Any]:
    from engine.cpu_info import cpu_model

    kinds = [k for k in args.attacks.replace(" ", "").split(",") if k]
    if not kinds or any(k not in ATTACKS for k in kinds):
        raise ValueError(f"--attacks: {args.attacks!r}: choose from {', '.join(ATTACKS)}")
    config = bench_config(args)
    spawn = multiprocessing.get_context("spawn")
    out: dict[str, Any] = {"cpu": cpu_model(), "seconds_per_attack": args.seconds, "attacks": {}}
    with local_ray(config, args.in_process), serving(config, "stranger", args.in_process) as handle:
        pids = {"router": os.getpid()} | {
            info["name"]: int(info["pid"]) for info in handle.worker_infos() if int(info["pid"]) != os.getpid()
        }
        targets = _targets(handle)
        out["processes"] = {name: {"pid": pid, "rss_mb": round(rss_mb(pid) or 0.0, 1)} for name, pid in pids.items()}
        out["sockets"] = [{k: t[k] for k in ("plane", "owner", "port")} for t in targets]
        before = _refused(handle)
        for kind in kinds:
            # a fresh baseline process per attack: memory a previous attack made it hold would hide this one's
            ports = spawn.Queue()
            plain = spawn.Process(target=unguarded, args=(ports, args.seconds + 60), daemon=True)
            plain.start()
            plain_control, plain_kv = ports.get(timeout=30)
            pids[UNGUARDED] = plain.pid or 0
            plain_targets = [
                {"plane": "control", "owner": UNGUARDED, "host": "127.0.0.1", "port": plain_control},
                {"plane": "kv", "owner": UNGUARDED, "host": "127.0.0.1", "port": plain_kv},
            ]
            with Sampler(pids) as baseline:
                time.sleep(1.0)
            with Sampler(pids) as during:
                proc = spawn.Process(target=attack, args=(kind, targets + plain_targets, args.seconds), daemon=True)
                proc.start()
                proc.join(timeout=args.seconds + 30)
                if proc.is_alive():
                    proc.kill()
                    proc.join(5)
            plain.kill()
            plain.join(5)
            peaks = {}
            for name in pids:
                base = statistics.median(baseline.samples[name]) if baseline.samples[name] else 0.0
                peaks[name] = round(max(during.samples[name], default=base) - base, 1)
            cluster = [peak for name, peak in peaks.items() if name != UNGUARDED]
            out["attacks"][kind] = {"peak_over_baseline_mb": peaks, "max_mb": max(cluster)}
            print(f"stranger: {kind}: {peaks}", file=sys.stderr)
        after = _refused(handle)
        out["handshakes_refused"] = {name: after.get(name, 0) - before.get(name, 0) for name in after}
        out["served_after"] = _serves(handle, config)
        out["kv_free_after"] = _kv_free(handle)
    worst = max((a["max_mb"] for a in out["attacks"].values()), default=0.0)
    out["goals"] = {
        "max_memory_moved_mb": worst,
        "memory_within_50mb": worst <= GOAL_MB,
        "all_met": worst <= GOAL_MB and out["served_after"] and out["kv_free_after"],
    }
    return out


def main(argv: list[str] | None = None) -> int:
    from bench.loadtest.cli import run_main

    return run_main("python -m benchmarks.stranger_bench", (__doc__ or "").splitlines()[0], add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
