"""Peer processes for the two-process tests (multiprocessing spawn): a sender and a receiver.

Each reports over a multiprocessing queue and exits; tests kill them by pid to simulate a dead peer.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tests.helpers.kv import Cache, fingerprint, make_kv, poll_until
from transfer.base import make_receiver, make_sender
from transfer.config import TransferConfig


def sender_main(jobs: list[dict], out, stall_after: int | None = None) -> None:
    """jobs: [{backend, address, dtype, tid, dst, seed}]. Sends every layer of every job, then waits
    for the outcome of each; with stall_after, stops after that many layers and sleeps (to be killed)."""
    cfg = TransferConfig(group_timeout_s=20.0, lease_s=10.0)
    senders = []
    for j in jobs:
        fp = fingerprint(j["dtype"])
        s = make_sender(j["backend"], fp, cfg)
        senders.append(s)
        s.begin(j["tid"], j["address"])
        for layer in range(fp.num_layers):
            if stall_after is not None and layer >= stall_after:
                out.put(("stalled", j["tid"]))
                time.sleep(3600)
            k, v = make_kv(fp, layer, len(j["dst"]), j["seed"])
            s.send_layer(j["tid"], layer, j["dst"], k, v)
        s.finish(j["tid"])
    events = poll_until([s.poll for s in senders], lambda ev: len(ev) >= len(jobs), 30.0)
    out.put(
        (
            "events",
            [(e.transfer_id, e.state.name, repr(e.error)) for e in events],
            [s.active_transfers() for s in senders],
        )
    )
    for s in senders:
        s.close()


@contextmanager
def stalled_sender(spawn, backend: str, address: str, tid: str, dst: list[int], layers: int = 2) -> Iterator[Any]:
    """A sender process that has sent `layers` layers of one float16 transfer (seed 2) and sleeps: yields it, to be
    killed by its pid; killed at exit if it is still alive."""
    q = spawn.Queue()
    job = dict(backend=backend, address=address, dtype="float16", tid=tid, dst=dst, seed=2)
    p = spawn.Process(target=sender_main, args=([job], q, layers), daemon=True)
    p.start()
    try:
        assert q.get(timeout=30)[0] == "stalled"
        yield p
    finally:
        if p.is_alive():
            p.kill()


def receiver_main(backend: str, address: str, dtype: str, tid: str, dst: list[int], out) -> None:
    """Expects one transfer, reports its address, then polls (to be killed mid-transfer)."""
    fp = fingerprint(dtype)
    cache = Cache(fp)
    r = make_receiver(backend, fp, cache.sink, address, TransferConfig())
    r.expect(tid, dst)
    out.put(("address", r.address))
    end = time.monotonic() + 60
    while time.monotonic() < end:
        for ev in r.poll():
            out.put(("event", ev.transfer_id, ev.state.name))
        time.sleep(0.001)
