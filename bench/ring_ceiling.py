"""The ceiling of a two-copy shared-memory transfer on this machine: what `shm` could reach with no protocol at all.

The goal for `shm` is 0.5x memcpy at 64 MiB; the backend makes exactly two copies per byte (the sender's into the
ring, the sink's out of it) and one xxh3 pass on each side. This runs just that: a sender process copies the frames
into a shared-memory ring and hashes its copy, the receiver hashes each frame in the ring and copies it out, and the
two meet through two u64 counters (no header, MAC, socket, lease or Python object per piece). Its ratio to memcpy in
the same run is the most the design can give on this box; the gap to the shm row is what the protocol costs.

    python -m bench.ring_ceiling --mib 64 --reps 9     # prints one JSON object
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from multiprocessing import shared_memory
from typing import Any

import numpy as np
import xxhash

CONTROL_BYTES = 4096  # head counter at 0, tail at 64, start signal at 128: separate cache lines
HEAD, TAIL, START, STOP = 0, 8, 16, 24  # u64 indices
RING_BYTES = 32 << 20  # the shm backend's default ring
WAIT_S = 30.0  # a side that waits longer than this for the other gives up (the other died)


def _frames(total_bytes: int, frame_bytes: int) -> list[tuple[int, int]]:
    """(offset, size) of the frames a transfer of `total_bytes` sends: the benchmark's k and v of each layer."""
    return [(o, min(frame_bytes, total_bytes - o)) for o in range(0, total_bytes, frame_bytes)]


def _slot(pos: int, n: int, ring_bytes: int) -> int:
    """Where a frame written at virtual position `pos` starts: 64-byte aligned, never across the ring's end."""
    pos = -(-pos // 64) * 64
    if pos % ring_bytes + n > ring_bytes:
        pos = (pos // ring_bytes + 1) * ring_bytes
    return pos


def _payload(total_bytes: int) -> np.ndarray:
    """What the sender sends; the receiver makes the same to check what arrived."""
    return np.random.default_rng(0).integers(0, 255, total_bytes, dtype=np.uint8)


def _wait(ctl: np.ndarray, index: int, done: Any) -> None:
    """Spin (yielding the core) until done(ctl[index]); bounded by WAIT_S."""
    until = time.monotonic() + WAIT_S
    while not done(int(ctl[index])):
        if time.monotonic() > until:
            raise TimeoutError("the other side of the ring stopped")
        time.sleep(0)


def _sender(name: str, total_bytes: int, frame_bytes: int, ring_bytes: int, reps: int, checksum: bool) -> None:
    shm = shared_memory.SharedMemory(name=name)
    try:
        ctl = np.ndarray((CONTROL_BYTES // 8,), dtype=np.uint64, buffer=shm.buf)
        data = np.ndarray((ring_bytes,), dtype=np.uint8, buffer=shm.buf, offset=CONTROL_BYTES)
        src = _payload(total_bytes)
        head = 0
        for rep in range(reps):
            _wait(ctl, START, lambda v, rep=rep: v == rep + 1)
            for offset, n in _frames(total_bytes, frame_bytes):
                pos = _slot(head, n, ring_bytes)
                _wait(ctl, TAIL, lambda tail, end=pos + n: end - tail <= ring_bytes)
                copy = data[pos % ring_bytes : pos % ring_bytes + n]
                np.copyto(copy, src[offset : offset + n])
                if checksum:
                    xxhash.xxh3_64_intdigest(copy)
                head = pos + n
                ctl[HEAD] = head
        del ctl, data
    finally:
        shm.close()


def measure(total_bytes: int, frame_bytes: int, reps: int, checksum: bool = True, ring_bytes: int = RING_BYTES) -> dict:
    """Median GB/s of the bare two-copy ring and of memcpy (the transfer bench's reference), rep by rep."""
    from bench.memcpy import Memcpy  # every row's reference; here, not above: the sender process needs no torch

    shm = shared_memory.SharedMemory(create=True, size=CONTROL_BYTES + ring_bytes)
    proc = None
    try:
        ctl = np.ndarray((CONTROL_BYTES // 8,), dtype=np.uint64, buffer=shm.buf)
        ctl[:] = 0
        data = np.ndarray((ring_bytes,), dtype=np.uint8, buffer=shm.buf, offset=CONTROL_BYTES)
        data[:] = 0  # fault the ring in, as the backend does at the session's start
        dst = np.ones(total_bytes, dtype=np.uint8)
        args = (shm.name, total_bytes, frame_bytes, ring_bytes, reps + 1, checksum)
        proc = mp.get_context("spawn").Process(target=_sender, args=args, daemon=True)
        proc.start()
        ref = Memcpy(total_bytes)
        times, ref_times, tail = [], [], 0
        for rep in range(reps + 1):
            t0 = time.perf_counter()
            ctl[START] = rep + 1
            for offset, n in _frames(total_bytes, frame_bytes):
                pos = _slot(tail, n, ring_bytes)
                _wait(ctl, HEAD, lambda head, end=pos + n: head >= end)
                view = data[pos % ring_bytes : pos % ring_bytes + n]
                if checksum:
                    xxhash.xxh3_64_intdigest(view)
                np.copyto(dst[offset : offset + n], view)
                tail = pos + n
                ctl[TAIL] = tail
            times.append(time.perf_counter() - t0)
            ref_times.append(ref.once())
        proc.join(WAIT_S)
        intact = bool(np.array_equal(dst, _payload(total_bytes)))  # the last rep's bytes, all in place
        del ctl, data, view
    finally:
        if proc is not None and proc.is_alive():
            proc.kill()
        shm.close()
        shm.unlink()
    gbps = total_bytes / statistics.median(times[1:]) / 1e9
    ref_gbps = total_bytes / statistics.median(ref_times[1:]) / 1e9
    return {
        "gbps": round(gbps, 3),
        "memcpy_gbps": round(ref_gbps, 3),
        "ratio_vs_memcpy": round(gbps / ref_gbps, 3),
        "intact": intact,
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=64)
    ap.add_argument("--frame-kib", type=int, default=1080, help="bytes per frame (the bench's k or v of a layer)")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--no-checksum", action="store_true")
    a = ap.parse_args(sys.argv[1:])
    row = measure(int(a.mib * (1 << 20)), a.frame_kib << 10, a.reps, not a.no_checksum)
    print(json.dumps({"mib": a.mib, "checksum": not a.no_checksum, **row}))
