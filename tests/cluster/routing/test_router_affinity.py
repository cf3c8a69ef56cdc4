"""``Router.generate(..., affinity=<earlier request id>)``: a request lands on the workers an earlier one used.

What the API's n > 1 relies on: the choices after the first go where the prompt was computed, so its blocks are in
that worker's prefix cache and the prompt is computed once. The router remembers each request's placement (bounded);
the preferred worker wins over the policy while it is live and routable and, for a decode reservation, has room;
otherwise the policy decides as usual. Checked with round-robin policies, which without affinity spread consecutive
requests over the workers, so landing on the same one is the affinity's doing.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from cluster.routing.policies import Placement, Placements
from cluster.routing.router import Router
from engine.request import SamplingParams
from tests.cluster.routing.test_flow import PROMPT, collect
from tests.helpers.cluster import metric_value, wait_until

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
    placements = handle.router.core.placements
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
    placements = handle.router.core.placements
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
    home = router.core.placements.get("first").decode

    async def without_home() -> list:
        router.mark_dead(home, "test: cut off")  # its next heartbeat revives it; the pick below comes first
        return [event async for event in router.generate(PROMPT, PARAMS, "moved", affinity="first")]

    events = asyncio.run_coroutine_threadsafe(without_home(), router.loop).result(timeout=120)
    assert sum(e.num_tokens for e in events) == 4
    assert router.core.placements.get("moved").decode not in (None, home)


def test_placements_are_bounded_and_a_new_dispatch_replaces_its_record():
    placements = Placements(capacity=3)
    for index in range(5):
        placements.record(f"r{index}", None, f"w{index % 2}")
    assert len(placements) == 3 and placements.get("r0") is None and placements.get("r1") is None
    placements.record("r2", "p", "w9")  # a retry's dispatch: the record is its latest, and the newest again
    placements.record("r5", None, "w0")
    assert placements.get("r2") == Placement("p", "w9") and placements.get("r3") is None
