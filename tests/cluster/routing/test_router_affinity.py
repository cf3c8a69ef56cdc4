"""``Router.generate(..., affinity=<earlier request id>)``: a request lands on the workers an earlier one used.

What the API's n > 1 relies on: the choices after the first go where the prompt was computed, so its blocks are in
that worker's prefix cache and the prompt is computed once. The router remembers each request's placement (bounded);
the preferred worker wins over the policy while it is live and routable and, for a decode reservation, has room;
otherwise the policy decides as usual. Checked with round-robin policies, which without affinity spread consecutive
requests over the workers, so landing on the same one is the affinity's doing.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from cluster.routing.admission import Admission
from cluster.routing.membership import WorkerHandle
from cluster.routing.metrics import RouterMetrics
from cluster.routing.policies import Placement, Placements, make_policy
from cluster.routing.reservations import DecodeReservations
from cluster.routing.router import Router
from engine.request import SamplingParams
from tests.cluster.routing.test_streams import PROMPT, collect
from tests.helpers.cluster import metric_value, tiny_cluster_config, wait_until
from worker.messages import Reserve, Reserved, Stats, WorkerCounters, WorkerLoad

pytestmark = pytest.mark.timeout(300)

WORKER = {"torch_threads": 1, "kv_blocks": 96}
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
ROUND_ROBIN = {"port": 0, "prefill_policy": "round_robin", "decode_policy": "round_robin"}


def _prefix_hits(handle) -> dict[str, int]:
    """Each worker's engine-side count of prompt tokens its prefix cache spared (its heartbeat's counter)."""
    status = httpx.get(f"{handle.base_url}/status", timeout=5).json()
    return {w["name"]: w.get("prefix_hit_tokens", 0) for w in status["workers"]}


def _affinity_decisions(handle, pool: str) -> float:
    return metric_value(handle.base_url, "pdserve_routing_decisions_total", pool=pool, reason="affinity") or 0.0


def test_colocated_requests_with_affinity_land_on_the_first_ones_worker(serve):
    handle = serve(mode="colocated", router=ROUND_ROBIN)  # two colocated workers (one per pool's replica)
    placements = handle.router.placements
    collect(handle, PROMPT, PARAMS, "first")
    collect(handle, PROMPT, PARAMS, "plain")  # round robin: the next worker
    assert placements.get("first").decode != placements.get("plain").decode and placements.get("first").prefill is None
    hits = _prefix_hits(handle)
    for index in range(4):
        collect(handle, PROMPT, PARAMS, f"choice-{index}", affinity="first")
        assert placements.get(f"choice-{index}") == placements.get("first")
    assert _affinity_decisions(handle, "colocated") == 4
    # each choice found the prompt's two full blocks (of its 40 tokens) in that worker's prefix cache; the other
    # worker computed nothing more
    home = placements.get("first").decode
    wait_until(lambda: _prefix_hits(handle)[home] - hits[home] == 4 * 32, timeout_s=10)
    assert all(hits_now == hits[name] for name, hits_now in _prefix_hits(handle).items() if name != home)


def test_disaggregated_requests_with_affinity_land_on_the_first_ones_prefill_and_decode_workers(serve):
    pools = {"prefill": {"replicas": 2, **WORKER}, "decode": {"replicas": 2, **WORKER, "kv_blocks": 160}}
    handle = serve(pools=pools, router=ROUND_ROBIN)
    placements = handle.router.placements
    collect(handle, PROMPT, PARAMS, "first")
    collect(handle, PROMPT, PARAMS, "plain")
    first = placements.get("first")
    assert first.prefill is not None and first.decode is not None
    assert placements.get("plain") != first  # round robin moved on (both pools)
    for index in range(4):
        collect(handle, PROMPT, PARAMS, f"choice-{index}", affinity="first")
        assert placements.get(f"choice-{index}") == first
    assert _affinity_decisions(handle, "decode") == 4 and _affinity_decisions(handle, "prefill") == 4
    # an id the router does not know is no preference: the policy decides, and the request is served
    assert sum(e.num_tokens for e in collect(handle, PROMPT, PARAMS, "stranger", affinity="no-such-request")) == 4


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_a_preferred_worker_that_is_not_live_is_passed_over(serve, mode):
    if mode == "colocated":
        handle = serve(mode="colocated", router=ROUND_ROBIN)
    else:
        pools = {"prefill": {"replicas": 1, **WORKER}, "decode": {"replicas": 2, **WORKER, "kv_blocks": 160}}
        handle = serve(pools=pools, router=ROUND_ROBIN)
    router: Router = handle.router
    collect(handle, PROMPT, PARAMS, "first")
    home = router.placements.get("first").decode

    async def without_home() -> list:
        router.mark_dead(home, "test: cut off")  # its next heartbeat revives it; the pick below comes first
        return [event async for event in router.generate(PROMPT, PARAMS, "moved", affinity="first")]

    events = asyncio.run_coroutine_threadsafe(without_home(), router.loop).result(timeout=120)
    assert sum(e.num_tokens for e in events) == 4
    assert router.placements.get("moved").decode not in (None, home)


def test_placements_are_bounded_and_a_new_dispatch_replaces_its_record():
    placements = Placements(capacity=3)
    for index in range(5):
        placements.record(f"r{index}", None, f"w{index % 2}")
    assert len(placements) == 3 and placements.get("r0") is None and placements.get("r1") is None
    placements.record("r2", "p", "w9")  # a retry's dispatch: the record is its latest, and the newest again
    placements.record("r5", None, "w0")
    assert placements.get("r2") == Placement("p", "w9") and placements.get("r3") is None


# ---- the decode reservation's preference, without a cluster ------------------------------------------------------


def _worker(name: str, free_blocks: int) -> WorkerHandle:
    load = WorkerLoad(free_blocks=free_blocks, total_blocks=100)
    stats = Stats(worker=name, role="decode", address="", load=load, counters=WorkerCounters())
    return WorkerHandle(name, "decode", f"inproc://{name}", socket=None, stats=stats)  # type: ignore[arg-type]


class _Decoders:
    """Plays the decode workers: answers each ``reserve`` with ok, unless the worker is listed as full."""

    def __init__(self, full: set[str]) -> None:
        self.full = full
        self.asked: list[str] = []
        self.reservations: DecodeReservations | None = None

    def send(self, worker: WorkerHandle, message) -> None:
        assert isinstance(message, Reserve)
        self.asked.append(worker.name)
        ok = worker.name not in self.full
        reply = Reserved(
            rid=message.rid, worker=worker.name, ok=ok, attempt=message.attempt, reason=None if ok else "kv_full"
        )
        asyncio.get_running_loop().call_soon(self.reservations.on_reserved, reply, worker)


def _reserve(workers: list[WorkerHandle], prefer: str | None, full: set[str] = frozenset()) -> tuple[str, list[str]]:
    async def run() -> tuple[str, list[str]]:
        decoders = _Decoders(set(full))
        config = tiny_cluster_config("unused-model")
        policy = make_policy("round_robin")
        reservations = DecodeReservations(config, policy, RouterMetrics(), Admission(8), decoders.send)
        decoders.reservations = reservations
        deadline = time.monotonic() + 5
        chosen, reply = await reservations.reserve(lambda: workers, "r", [1] * 20, PARAMS, deadline, None, prefer)
        assert reply.ok
        return chosen.name, decoders.asked

    return asyncio.run(run())


def test_the_preferred_decode_worker_is_asked_first_when_it_has_room():
    workers = [_worker("d0", 50), _worker("d1", 50), _worker("d2", 50)]
    assert _reserve(workers, None) == ("d0", ["d0"])  # round robin's first
    assert _reserve(workers, "d2") == ("d2", ["d2"])


def test_without_room_the_preferred_decode_worker_gives_way_to_the_policy():
    # its heartbeat shows too few free blocks: not asked at all
    workers = [_worker("d0", 50), _worker("d1", 50), _worker("d2", 0)]
    assert _reserve(workers, "d2") == ("d0", ["d0"])
    # it looked free but refused (kv_full): the policy's order next
    workers = [_worker("d0", 50), _worker("d1", 50), _worker("d2", 50)]
    chosen, asked = _reserve(workers, "d2", full={"d2"})
    assert asked == ["d2", chosen] and chosen in ("d0", "d1")  # round robin picks anew among the rest
    # not live at all (not in the live list): no preference
    assert _reserve(workers[:2], "d2") == ("d0", ["d0"])


def test_concurrent_reservations_see_each_other_and_spread_over_the_decode_workers():
    """Two requests ordered before either reply comes back: the first attempt counts as load at once, so
    least_loaded sends the second elsewhere (it used to pick at random between equal workers: both could land on
    one). An attempt counts while it is asked; a granted one counts for its stream from its reply on (what
    ``Router._granted`` does, played here), a refused one not at all."""

    async def run() -> tuple[list[str], dict[str, int]]:
        workers = [_worker("d0", 50), _worker("d1", 50), _worker("d2", 50)]
        decoders = _Decoders({"d2"})
        config = tiny_cluster_config("unused-model")

        def granted(rid, worker):  # the router's part: the stream counts on its worker from its reply on
            worker.inflight += 1

        policy = make_policy("least_loaded")
        reservations = DecodeReservations(
            config, policy, RouterMetrics(), Admission(8), decoders.send, on_granted=granted
        )
        decoders.reservations = reservations
        deadline = time.monotonic() + 5
        picks = await asyncio.gather(
            *(reservations.reserve(lambda: workers, f"r{i}", [1] * 20, PARAMS, deadline) for i in range(2))
        )
        return sorted(chosen.name for chosen, _ in picks), {w.name: w.inflight for w in workers}

    for _ in range(20):  # the tie between equal workers breaks at random: many draws
        chosen, inflight = asyncio.run(run())
        assert chosen in (["d0", "d1"],), chosen  # d2 refuses (kv_full): never chosen, never left counted
        assert inflight == {"d0": 1, "d1": 1, "d2": 0}  # one stream each; no attempt left counted
