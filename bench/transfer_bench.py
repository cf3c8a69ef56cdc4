"""Transfer benchmark: achieved GB/s of each KV transfer backend against this machine's references.

The receiver (decode side) polls in this process; the sender is one spawned process keeping its senders across reps
(`local`: both here; `shm`: through the receiver's shared-memory ring, transfer/ring_path.py). KV is float16 blocks
shaped like SmolLM2-135M, one piece per layer, each size's payload made once in the warm-up (generating it before a
timed send leaves torch's OpenMP threads spinning on the transfer's cores). Time runs from the first send_layer to
the receiver's DONE (perf_counter is system-wide on Linux). Sinks copy into a preallocated cache single-threaded, as
the raw ZeroMQ reference does (no header, checksum, handshake or ack). Figures: medians of --reps after a warm-up;
memcpy (bench/memcpy.py) is timed after each of a row's transfers (`ratio_vs_memcpy`: a shared box's load hits
both); `ring-ceiling` (bench/ring_ceiling.py) is shm's no-protocol ceiling. How much of a transfer streaming hides
behind the prefill is an experiment of its own (`pdserve bench overlap`), as is the hand-off between tensor-parallel
engines (`pdserve bench tp-handoff`); `pdserve bench transfer --overlap` (this bench, then that one's figures under
"overlap") and `--degrees` (the hand-off instead) reach them from here as they always did, through cli/main.py's
``ROUTES`` (a source checkout's benchmarks/, which nothing in bench/ imports).

    python -m bench.transfer_bench            # prints one JSON object
    pdserve bench transfer --overlap --json   # plus the overlap figures under "overlap" (minutes)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch
import zmq

from bench import ring_ceiling
from bench.memcpy import Memcpy, copy_bytes
from bench.options import add_transfer_bench_arguments as add_arguments  # noqa: F401 (re-exported, light)
from transfer.base import make_receiver, make_sender
from transfer.config import TransferConfig
from transfer.kv_segment import KVSegment
from transfer.wire import ModelFingerprint

FP = ModelFingerprint("LlamaForCausalLM", "float16", 30, 3, 64, 16)  # SmolLM2-135M
BLOCK_BYTES = 2 * FP.num_layers * FP.block_size * FP.num_kv_heads * FP.head_dim * 2
BLOCK_ELEMS = FP.block_size * FP.num_kv_heads * FP.head_dim  # of K (or V) of one layer


def _blocks(size_mib: float) -> int:
    return max(1, round(size_mib * (1 << 20) / BLOCK_BYTES))


def _kv(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (n, *FP.block_shape)
    return [(torch.randn(shape).half(), torch.randn(shape).half()) for _ in range(FP.num_layers)]


def _transport(backend: str) -> str:
    return {"gloo": "gloo", "shm": "shm", "shm-direct": "shm"}.get(backend, "zmq")


def _child(conn: Any) -> None:
    """Sender process: one sender per backend and checksum setting, kept across a row's repetitions and closed after
    it (("close", backend, checksum)): a sender's I/O thread and a pair group's link threads wake up while idle, and
    the next rows (``local`` above all, all in the parent) measured 5-15 % slower beside them."""
    senders: dict[tuple[str, bool], Any] = {}
    ctx = zmq.Context()
    raw: dict[str, zmq.Socket] = {}
    payloads: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    conn.send("ready")  # imports done: a row in the parent never runs beside them
    while True:
        msg = conn.recv()
        if msg is None:
            break
        if msg[0] == "close":
            old = senders.pop((msg[1], msg[2]), None)
            if old is not None:
                old.close()
            conn.send("closed")
            continue
        backend, address, n, tid, checksum = msg
        kv = payloads.get(n) or payloads.setdefault(n, _kv(n))
        if backend.startswith("raw"):
            sock = raw.get(address)
            if sock is None:
                sock = raw[address] = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDTIMEO, 10000)
                sock.connect(address)
                time.sleep(0.2)
            t0, c0 = time.perf_counter(), time.process_time()
            for k, v in kv:
                sock.send_multipart(
                    [k.view(-1).view(torch.uint8).numpy(), v.view(-1).view(torch.uint8).numpy()], copy=False
                )
            conn.send((t0, "sent"))
            conn.recv()  # the receiver has it all: ZeroMQ's I/O thread is done with it
            conn.send(time.process_time() - c0)
            continue
        s = senders.get((backend, checksum))
        if s is None:
            s = senders[backend, checksum] = make_sender(_transport(backend), FP, TransferConfig(checksum=checksum))
        t0, c0 = time.perf_counter(), time.process_time()
        s.begin(tid, address)
        dst = list(range(n))
        for layer, (k, v) in enumerate(kv):
            s.send_layer(tid, layer, dst, k, v)
        s.finish(tid)
        ev: list = []
        end = time.monotonic() + 60
        while not ev and time.monotonic() < end:
            ev = s.poll()
            time.sleep(0.002)  # only ends the rep (its time is taken at the receiver): few wake-ups
        conn.send((t0, ev[0].state.name if ev else "no-event", time.process_time() - c0))
    for s in senders.values():
        s.close()
    ctx.destroy(linger=0)


class _Cache:
    """The destination: private tensors, or a decode worker's shared cache (``segment``) that senders write in place
    (then the sink is never called: counted in ``writes``)."""

    def __init__(self, n: int, segment: KVSegment | None = None, parallel: bool = False) -> None:
        shape = (n, *FP.block_shape)
        if segment is not None:
            self.k, self.v = [kv[0] for kv in segment.layers], [kv[1] for kv in segment.layers]
        else:
            self.k = [torch.empty(shape, dtype=torch.float16) for _ in range(FP.num_layers)]
            self.v = [torch.empty(shape, dtype=torch.float16) for _ in range(FP.num_layers)]
        self.writes = 0
        self.parallel = parallel
        # the caches' bytes per layer, viewed once: a piece's copy is then one numpy call, not a chain of torch views
        self.k_bytes = [t.view(torch.int16).numpy().reshape(-1) for t in self.k]
        self.v_bytes = [t.view(torch.int16).numpy().reshape(-1) for t in self.v]

    def sink(self, tid: str, layer: int, blocks: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Copy into the blocks (the bench sends contiguous ids). Single-threaded memcpy (numpy's, GIL released),
        as the raw ZeroMQ reference does: torch's parallel copy of a 1 MiB frame waits for a second OpenMP thread
        that a 2-core box has busy with the sender. In-process (`local`, ``parallel``), nothing else wants the second
        core: torch's copy, as the engine's sink does."""
        self.writes += 1
        if self.parallel:
            self.k[layer][blocks[0] : blocks[0] + len(blocks)].copy_(k)
            self.v[layer][blocks[0] : blocks[0] + len(blocks)].copy_(v)
            return
        span = slice(blocks[0] * BLOCK_ELEMS, (blocks[0] + len(blocks)) * BLOCK_ELEMS)
        np.copyto(self.k_bytes[layer][span], k.view(torch.int16).numpy().reshape(-1))
        np.copyto(self.v_bytes[layer][span], v.view(torch.int16).numpy().reshape(-1))


def _wait_done(r: Any, tid: str, timeout_s: float = 60) -> str:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        events = r.poll()
        for ev in events:
            if ev.transfer_id == tid:
                return ev.state.name
        if not events:
            r.wait(0.01)  # like an idle decode loop: do not spin against the I/O threads
    return "timeout"


def _raw_receive(sock: zmq.Socket, cache: _Cache, timeout_s: float = 60) -> None:
    end = time.monotonic() + timeout_s
    layer = 0
    while layer < FP.num_layers and time.monotonic() < end:
        if not sock.poll(100):
            continue
        _, kf, vf = sock.recv_multipart(copy=False)
        copy_bytes(cache.k[layer], torch.frombuffer(kf.buffer, dtype=torch.uint8))
        copy_bytes(cache.v[layer], torch.frombuffer(vf.buffer, dtype=torch.uint8))
        layer += 1


def _memcpy(nbytes: int, reps: int) -> float:
    ref = Memcpy(nbytes)
    return nbytes / statistics.median(ref.once() for _ in range(reps)) / 1e9


def _speed(nbytes: int, times: list[float], ref_times: list[float]) -> dict[str, float]:
    """A row's GB/s against memcpy timed after each of its transfers (a shared box's load hits both); medians of the
    timed reps (the first is the warm-up)."""
    gbps = nbytes / statistics.median(times[1:]) / 1e9
    ref_gbps = nbytes / statistics.median(ref_times[1:]) / 1e9
    return {"gbps": round(gbps, 3), "memcpy_gbps": round(ref_gbps, 3), "ratio_vs_memcpy": round(gbps / ref_gbps, 3)}


def _local(n: int, reps: int) -> dict[str, Any]:
    """The in-process hand-off: its row, with memcpy timed after each transfer as the other rows do."""
    nbytes = n * BLOCK_BYTES
    cache = _Cache(n, parallel=True)
    r = make_receiver("local", FP, cache.sink, f"local://bench-{n}")
    s = make_sender("local", FP)
    kv, times, ref_times, ref = _kv(n), [], [], Memcpy(nbytes)
    try:
        for i in range(reps + 1):
            tid = f"l{i}"
            r.expect(tid, list(range(n)))
            c0, t0 = time.thread_time(), time.perf_counter()
            s.begin(tid, r.address)
            for layer, (k, v) in enumerate(kv):
                s.send_layer(tid, layer, list(range(n)), k, v)
            s.finish(tid)
            assert _wait_done(r, tid) == "DONE"
            times.append((time.perf_counter() - t0, time.thread_time() - c0))
            ref_times.append(ref.once())
            s.poll()
    finally:
        s.close()
        r.close()
    cpu_ms = 1e3 * statistics.median(c for _, c in times[1:])
    return {
        "backend": "local",
        "mib": nbytes / (1 << 20),
        "bytes": nbytes,
        **_speed(nbytes, [t for t, _ in times], ref_times),
        "cpu_ms": {"both_sides": round(cpu_ms, 3)},  # one thread: the sends, the receiver's checks and the sink's copy
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = {m: _blocks(m) for m in args.sizes_mib}
    out: dict[str, Any] = {
        "kv": {
            "model": "SmolLM2-135M",
            "dtype": FP.dtype,
            "layers": FP.num_layers,
            "kv_heads": FP.num_kv_heads,
            "head_dim": FP.head_dim,
            "block_size": FP.block_size,
            "bytes_per_block": BLOCK_BYTES,
            "kv_bytes_per_token": BLOCK_BYTES // FP.block_size,
        },
        "checksum": not args.no_checksum,
        "reps": args.reps,
        "results": [],
        "memcpy_gbps": {},
        "raw_zmq_gbps": {},
    }
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child,), daemon=True)
    proc.start()
    if not parent.poll(120):
        raise RuntimeError("the sender process did not start within 120 s")
    parent.recv()
    zctx = zmq.Context()
    tmp = tempfile.mkdtemp(prefix="pdserve-bench-")
    try:
        for mib, n in sizes.items():
            nbytes = n * BLOCK_BYTES
            out["memcpy_gbps"][str(mib)] = round(_memcpy(nbytes, args.reps), 3)
            for backend in args.backends:
                if backend == "local":
                    out["results"].append({**_local(n, args.reps), "mib": mib})
                    continue
                # the direct path with and without checksums (its one copy leaves them the largest share)
                for checksum in [True, False] if backend == "shm-direct" else [not args.no_checksum]:
                    row = _row(args, parent, zctx, tmp, backend, mib, n, checksum)
                    out["results"].append(row)
                    raw_gbps = row.pop("raw_zmq_gbps", None)
                    if raw_gbps:
                        out["raw_zmq_gbps"].setdefault(backend, {})[str(mib)] = raw_gbps
            if "shm" in args.backends:
                frame = nbytes // (2 * FP.num_layers)
                ceiling = ring_ceiling.measure(nbytes, frame, args.reps, checksum=not args.no_checksum)
                out["results"].append({"backend": "ring-ceiling", "mib": mib, "bytes": nbytes, **ceiling})
        ceilings = {r["mib"]: r["gbps"] for r in out["results"] if r["backend"] == "ring-ceiling"}
        for row in out["results"]:
            if row["backend"] == "shm" and ceilings.get(row["mib"]):
                row["ratio_vs_ceiling"] = round(row["gbps"] / ceilings[row["mib"]], 3)
            raw = out["raw_zmq_gbps"].get(row["backend"], {}).get(str(row["mib"]))
            if raw:
                row["ratio_vs_raw_zmq"] = round(row["gbps"] / raw, 3)
            row.setdefault("ratio_vs_memcpy", round(row["gbps"] / out["memcpy_gbps"][str(row["mib"])], 3))
    finally:
        parent.send(None)
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        zctx.destroy(linger=0)
    return out


def _row(
    args: argparse.Namespace, parent: Any, zctx: zmq.Context, tmp: str, backend: str, mib: float, n: int, checksum: bool
) -> dict[str, Any]:
    """One backend at one size: --reps transfers (after a warm-up), each followed by memcpy and the raw reference."""
    nbytes = n * BLOCK_BYTES
    segment = KVSegment(FP, n) if backend == "shm-direct" else None  # the destination cache, written in place
    cache = _Cache(n, segment)
    addr = {
        "zmq-ipc": f"ipc://{tmp}/{backend}-{n}.ipc",
        "shm": f"shm+ipc://{tmp}/{backend}-{n}.ipc",  # control over a Unix socket, payload in /dev/shm
        "shm-direct": f"shm+ipc://{tmp}/{backend}-{n}-{int(checksum)}.ipc",
    }.get(backend, "tcp://127.0.0.1:0")
    cfg = TransferConfig(checksum=checksum)
    r = make_receiver(_transport(backend), FP, cache.sink, addr, cfg, segment)
    raw = _RawReceiver(zctx, backend, tmp, n) if backend.startswith("zmq") else None
    times, raw_times, ref_times, cpu = [], [], [], []
    ref = Memcpy(nbytes)
    try:
        # interleaved with memcpy and the raw reference rep by rep, so machine noise hits all alike
        for i in range(args.reps + 1):
            tid = f"{backend}-{mib}-{i}"
            r.expect(tid, list(range(n)))
            parent.send((backend, r.address, n, tid, checksum))
            c0 = time.thread_time()
            state = _wait_done(r, tid)
            t1, rcpu = time.perf_counter(), time.thread_time() - c0
            t0, sender_state, scpu = parent.recv()
            if state != "DONE" or sender_state != "DONE":
                raise RuntimeError(f"{backend} transfer {tid}: {state}/{sender_state}")
            times.append(t1 - t0)
            cpu.append((scpu, rcpu))
            ref_times.append(ref.once())
            if raw is not None:
                raw_times.append(raw.once(parent))
        if segment is not None and cache.writes:
            raise RuntimeError("shm-direct: pieces went through the sink, not in place")
    finally:
        r.close()
        if raw is not None:
            raw.close()
        parent.send(("close", backend, checksum))
        parent.recv()
    row: dict[str, Any] = {
        "backend": backend,
        "mib": mib,
        "bytes": nbytes,
        "checksum": checksum,
        **_speed(nbytes, times, ref_times),
        # CPU per transfer, sender process and receiver thread: little changed by a busy box's noise
        "cpu_ms": {
            "sender": round(1e3 * statistics.median(c[0] for c in cpu[1:]), 3),
            "receiver": round(1e3 * statistics.median(c[1] for c in cpu[1:]), 3),
        },
    }
    row["cpu_us_per_piece"] = {side: round(1e3 * ms / FP.num_layers, 1) for side, ms in row["cpu_ms"].items()}
    if raw_times:
        row["raw_zmq_gbps"] = round(nbytes / statistics.median(t for t, _, _ in raw_times[1:]) / 1e9, 3)
        # the same bytes as raw ZeroMQ messages (one per layer): what the sockets alone cost each side
        row["raw_zmq_cpu_ms"] = {
            "sender": round(1e3 * statistics.median(c for _, c, _ in raw_times[1:]), 3),
            "receiver": round(1e3 * statistics.median(c for _, _, c in raw_times[1:]), 3),
        }
    return row


class _RawReceiver:
    """The reference: same ROUTER/DEALER pair and frames, no header, checksum, handshake or ack."""

    def __init__(self, zctx: zmq.Context, backend: str, tmp: str, n: int) -> None:
        self.sock = zctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if backend == "zmq-ipc":
            self.addr = f"ipc://{tmp}/raw-{n}.ipc"
            self.sock.bind(self.addr)
        else:
            self.addr = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.backend, self.n, self.cache = backend, n, _Cache(n)

    def once(self, parent: Any) -> tuple[float, float, float]:
        """(seconds, sender process CPU, receiver thread CPU) of one transfer."""
        parent.send(("raw-" + self.backend, self.addr, self.n, "raw", False))
        c0 = time.thread_time()
        _raw_receive(self.sock, self.cache)
        t1, rcpu = time.perf_counter(), time.thread_time() - c0
        t0, _ = parent.recv()
        parent.send("received")
        return t1 - t0, parent.recv(), rcpu

    def close(self) -> None:
        self.sock.close(linger=0)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    parsed = ap.parse_args(sys.argv[1:])
    for flag, given in (("--overlap", parsed.overlap), ("--degrees", parsed.degrees)):
        if given:  # an experiment of the checkout: only the pdserve command reaches it
            ap.error(f"{flag} runs an experiment of benchmarks/: run `pdserve bench transfer {flag} ...` instead")
    print(json.dumps(run(parsed)))
