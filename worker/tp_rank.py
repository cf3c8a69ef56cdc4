"""The ranks of a tensor-parallel worker (``tensor_parallel_size`` N > 1) beyond rank 0.

Rank 0 is the worker (``WorkerRuntime``: the engine, its scheduler, the sockets); ranks 1..N-1 are ``TPRank``s, each
holding its shard of the model and of the KV heads, running every step rank 0 announces (engine.tensor_parallel), and
sending and taking its own heads of every hand-off on KV-plane endpoints of its own (worker/rank_kv.py).
All N meet once per incarnation on a FileStore at ``spec.tp_rendezvous`` (one node, no socket; the pool picks a fresh
path for every start, so a restarted worker never meets its previous incarnation's keys). A rank that ends (rank 0
stopped, or the group broke) does not come back alone: the pool restarts all N together.
"""

from __future__ import annotations

import datetime
import threading

from engine.engine_parts import EngineParts, build_engine_parts
from engine.rank_tiers import follower_tiers
from engine.tensor_parallel import TP_START_TIMEOUT_S, TP_TIMEOUT_S, StepChannel, TPFollower, TPGroup
from worker.rank_kv import RankKV, cache_land, handoff_layout, rank_kv
from worker.spec import WorkerRole, WorkerSpec, resolve_spec


def join_group(spec: WorkerSpec, rank: int, timeout_s: float = TP_TIMEOUT_S) -> TPGroup | None:
    """This rank's tensor-parallel group (None at degree 1)."""
    import torch.distributed as dist

    size = spec.engine.ranks
    if size == 1:
        return None
    if not spec.tp_rendezvous:
        raise ValueError(f"worker {spec.name}: {size} ranks need a rendezvous path (the pool sets it)")
    store = dist.FileStore(spec.tp_rendezvous, size)
    store.set_timeout(datetime.timedelta(seconds=TP_START_TIMEOUT_S))
    # the ranks share a node: loopback; the layers' collectives on NCCL when the engine's device is a GPU
    return TPGroup(store, rank, size, timeout_s, host="127.0.0.1", device=spec.engine.device)


class TPRank:
    """One rank other than 0: its shard, served from a thread until rank 0 stops it or the group breaks."""

    def __init__(self, spec: WorkerSpec, rank: int) -> None:
        if not 0 < rank < spec.engine.ranks:
            raise ValueError(f"worker {spec.name}: rank {rank} outside 1..{spec.engine.ranks - 1}")
        spec = resolve_spec(spec)
        self.name, self.rank = f"{spec.name}/rank{rank}", rank
        group = join_group(spec, rank)
        assert group is not None  # degree > 1, checked above
        self.group = group
        try:
            parts = build_engine_parts(spec.engine, group)
        except BaseException:
            group.close()
            raise
        self.kv_heads = parts.kv_spec.num_kv_heads
        try:
            self.kv = follower_kv(spec, parts)
            tiers = follower_tiers(parts)  # with kv_offload: this rank pages its own heads (engine.rank_tiers)
        except BaseException:
            group.close()
            raise
        self.follower = TPFollower(parts.runner, StepChannel(group), self.kv, tiers)
        self.ended = ""  # why serving ended ("stop", or the group's failure); "" while it serves
        self._thread = threading.Thread(target=self._serve, name=f"{self.name}-serve", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            self.ended = self.follower.serve()
        finally:
            self.group.close()
            self.kv.close()

    def wait(self, timeout_s: float = TP_START_TIMEOUT_S) -> str:
        """Block until serving ends (rank 0 stopped, or the group broke, or ``timeout_s``); why it ended."""
        self._thread.join(timeout_s)
        return self.ended

    def info(self) -> dict:
        return {
            "name": self.name,
            "rank": self.rank,
            "serving": self._thread.is_alive(),
            "ended": self.ended,
            "steps": self.follower.steps,
            "kv_heads": self.kv_heads,
        }

    def stop(self, timeout_s: float = 10.0) -> None:
        """Rank 0's stop normally ends serving first; otherwise drop the group so that the wait fails now."""
        self._thread.join(0.5)
        if self._thread.is_alive():
            self.group.close()
            self._thread.join(timeout_s)


def follower_kv(spec: WorkerSpec, parts: EngineParts) -> RankKV:
    """A rank's own KV-plane endpoints: senders for the hand-offs its worker sends, and (a decode worker) a receiver
    whose arrivals land in its cache, polled by a thread of its own. Only blocks an expected part names are written:
    rank 0 tells it which (``Expect``), in order with the steps that may reuse them."""
    land = cache_land(parts.kv_cache) if spec.role is WorkerRole.DECODE else None
    kv = rank_kv(spec, parts.kv_cache, handoff_layout(parts.kv_spec, parts.runner.head_split), land)
    kv.start_polling()
    return kv
