"""Running the N ranks of one tensor-parallel engine as processes of this host, for tests and benchmarks.

Each rank is a spawned process (no fork of a process that holds threads) calling ``target(rank, size, store_path,
payload)``; the ranks meet on a ``torch.distributed.FileStore`` at ``store_path`` (no socket), and each returns a
picklable result or raises. The results come back over a multiprocessing queue within ``timeout_s``; a rank that
neither reported nor exited by then is killed, so a broken group never outlives the call.
"""

from __future__ import annotations

import io
import multiprocessing
import queue
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.engine_parts import EngineParts, build_engine_parts
from engine.rank_tiers import follower_tiers
from engine.tensor_parallel import FollowerKV, StepChannel, TPFollower, TPGroup

RankTarget = Callable[[int, int, str, Any], Any]


class RankFailed(RuntimeError):
    """A rank raised, or never reported: ``errors`` maps each such rank to its traceback or what is known."""

    def __init__(self, errors: dict[int, str]) -> None:
        super().__init__("; ".join(f"rank {r}: {e.strip().splitlines()[-1] if e else ''}" for r, e in errors.items()))
        self.errors = errors


def _main(target: RankTarget, rank: int, size: int, store_path: str, payload: Any, results: Any) -> None:
    try:
        # serialized here, by value: a queue would share a tensor's storage with this process, which is about to end
        buffer = io.BytesIO()
        torch.save(target(rank, size, store_path, payload), buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - sent to the caller, which raises it as RankFailed
        results.put((rank, False, traceback.format_exc()))


def run_ranks(
    target: RankTarget, size: int, payload: Any, timeout_s: float = 600.0, expect_missing: frozenset[int] = frozenset()
) -> dict[int, Any]:
    """Each rank's result. ``expect_missing``: ranks that may end without reporting (a test that kills one)."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="pdserve-tp-") as folder:
        store = str(Path(folder) / "store")
        procs = [ctx.Process(target=_main, args=(target, r, size, store, payload, results)) for r in range(size)]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        try:
            while len(out) + len(errors) < size - len(expect_missing):
                rank, ok, value = results.get(timeout=timeout_s)
                # tensors, containers and plain values only: the loader runs no code from what it reads
                (out if ok else errors)[rank] = torch.load(io.BytesIO(value), weights_only=True) if ok else value
        except queue.Empty:
            pass
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
    silent = set(range(size)) - set(out) - set(errors) - set(expect_missing)
    errors |= {r: f"rank {r} never reported within {timeout_s:.0f} s" for r in silent}
    if errors:
        raise RankFailed(errors)
    return out


def serve_follower(
    config: EngineConfig, group: TPGroup, make_kv: Callable[[EngineParts], FollowerKV] | None = None
) -> str:
    """A rank other than 0 inside a target: its shard of ``config``'s engine runs rank 0's steps until rank 0 stops it
    or the group breaks; the group is closed after; why serving ended. ``make_kv``: the rank's KV-plane endpoints
    (worker/rank_kv.py), for a target that hands KV between workers. With ``kv_offload``, the rank pages its own heads
    (engine.rank_tiers)."""
    parts = build_engine_parts(config, group)
    kv = make_kv(parts) if make_kv is not None else None
    try:
        return TPFollower(parts.runner, StepChannel(group), kv, follower_tiers(parts)).serve()
    finally:
        group.close()
        if kv is not None:
            kv.close()
