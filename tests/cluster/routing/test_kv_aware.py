"""kv_aware routing end to end: a tiny in-process cluster with two prefill workers, through HTTP.

Requests that share a long prefix go to the prefill worker that computed it (its engine's prefix hits grow, the
other's do not), /metrics shows the decisions and the hit rate, the output is the same as least_loaded's, and nothing
leaks (the ``serve`` fixture checks every block is free at the end).
"""

from __future__ import annotations

import httpx
import pytest

from engine.blocks import prompt_block_hashes
from tests.helpers.cluster import metric_value, wait_until
from tests.helpers.engine import random_prompts
from worker.messages import KvEvents

pytestmark = pytest.mark.timeout(300)

BLOCK = 16
PREFIX = random_prompts(1, 8 * BLOCK, 8 * BLOCK, seed=41)[0]  # eight full blocks shared by every request
SUFFIXES = random_prompts(5, 3, 20, seed=42)


def _pools(prefill_replicas: int) -> dict:
    worker = {"torch_threads": 1, "kv_blocks": 96}
    return {"prefill": {"replicas": prefill_replicas, **worker}, "decode": {"replicas": 1, **worker, "kv_blocks": 160}}


def _complete(handle, prompt: list[int]) -> str:
    body = {"model": handle.config.served_model_name, "prompt": prompt, "max_tokens": 6, "temperature": 0}
    response = httpx.post(f"{handle.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def _prefix_hits(handle, role: str = "prefill") -> dict[str, int]:
    """Each worker's engine-side count of prompt tokens its prefix cache spared."""
    status = httpx.get(f"{handle.base_url}/status", timeout=5).json()
    return {w["name"]: w.get("prefix_hit_tokens", 0) for w in status["workers"] if w["role"] == role}


def _holder(handle) -> str | None:
    """The prefill worker the router knows holds all of PREFIX (None until its KV events arrived)."""
    matched = handle.router.members.prefix_index.match(prompt_block_hashes(PREFIX, BLOCK))
    full = [name for name, blocks in matched.items() if blocks == 8 and name.startswith("prefill")]
    return full[0] if full else None


def test_shared_prefix_requests_go_to_the_worker_that_holds_it(serve):
    kv_aware = serve(pools=_pools(2), router={"port": 0, "prefill_policy": "kv_aware"})
    assert kv_aware.config.transfer.block_size == BLOCK
    texts = [_complete(kv_aware, PREFIX + SUFFIXES[0])]
    wait_until(lambda: _holder(kv_aware) is not None, timeout_s=10)
    holder = _holder(kv_aware)
    other = next(name for name in _prefix_hits(kv_aware) if name != holder)
    before = _prefix_hits(kv_aware)
    for suffix in SUFFIXES[1:]:
        texts.append(_complete(kv_aware, PREFIX + suffix))

    # the engine of the worker that holds the prefix reused it for every later request; the other never ran one
    def hits_settled() -> bool:
        hits = _prefix_hits(kv_aware)
        return hits[holder] - before[holder] == len(PREFIX) * (len(SUFFIXES) - 1)

    wait_until(hits_settled, timeout_s=10)
    assert _prefix_hits(kv_aware)[other] == before[other] == 0

    # /metrics: every later pick was decided by the prefix; the predicted hit rate is the engine's real one
    url = kv_aware.base_url
    # (a worker marked dead under a starved CPU loses its view until its next snapshot: say so if that happened)
    view_lost = {k: metric_value(url, "pdserve_kv_events_total", kind=k) for k in ("gap", "reset")}
    assert metric_value(url, "pdserve_worker_revivals_total") == 0 and not view_lost["gap"], view_lost
    assert metric_value(url, "pdserve_routing_decisions_total", pool="prefill", reason="prefix") == len(SUFFIXES) - 1
    assert metric_value(url, "pdserve_routing_decisions_total", pool="prefill", reason="load") == 1
    routed = metric_value(url, "pdserve_routed_prompt_tokens_total", pool="prefill")
    matched = metric_value(url, "pdserve_prefix_matched_tokens_total", pool="prefill")
    assert routed == sum(len(PREFIX) + len(s) for s in SUFFIXES)
    assert matched == len(PREFIX) * (len(SUFFIXES) - 1)
    assert 0.5 < matched / routed < 1
    assert metric_value(url, "pdserve_prefix_index_blocks", worker=holder, pool="prefill", tier="device") >= 8

    # the same requests, routed by load only: the same greedy text
    least_loaded = serve(pools=_pools(2), router={"port": 0, "prefill_policy": "least_loaded"})
    assert [_complete(least_loaded, PREFIX + suffix) for suffix in SUFFIXES] == texts
    assert metric_value(least_loaded.base_url, "pdserve_routing_decisions_total", pool="prefill", reason="load") == 5


def test_a_follow_up_sent_before_the_kv_events_arrive_goes_to_the_same_worker(serve):
    """The router records at dispatch that the chosen workers will hold the prompt (``PrefixIndex.expect``): with the
    workers' KV events held back (as if late), later requests with the same prefix still go to the prefill worker
    that computed it, whose engine reuses it; when the events arrive they confirm those entries."""
    handle = serve(pools=_pools(2), router={"port": 0, "prefill_policy": "kv_aware"})
    router, index = handle.router, handle.router.members.prefix_index
    held: list = []
    original = router.on_event
    router.on_event = lambda event: held.append(event) if isinstance(event, KvEvents) else original(event)  # delayed
    _complete(handle, PREFIX + SUFFIXES[0])
    [holder] = [name for name, n in index.match(prompt_block_hashes(PREFIX, BLOCK)).items() if name.startswith("pre")]
    assert index.tentative_blocks(holder) >= 8  # known from the dispatch alone
    before = _prefix_hits(handle)
    for suffix in SUFFIXES[1:3]:
        _complete(handle, PREFIX + suffix)
    wait_until(lambda: _prefix_hits(handle)[holder] - before[holder] == 2 * len(PREFIX), timeout_s=10)
    assert all(hits == before[name] for name, hits in _prefix_hits(handle).items() if name != holder)
    url = handle.base_url
    assert metric_value(url, "pdserve_routing_decisions_total", pool="prefill", reason="prefix") == 2
    assert metric_value(url, "pdserve_kv_events_total", kind="delta") in (None, 0)  # none applied so far

    def deliver() -> None:
        router.on_event = original
        for event in held:
            original(event)

    router._call_threadsafe(deliver)
    wait_until(lambda: index.tentative_blocks(holder) == 0, timeout_s=10)  # every dispatched block was stored
    assert index.match(prompt_block_hashes(PREFIX, BLOCK))[holder] == 8


def test_colocated_workers_are_chosen_by_prefix_too(serve):
    handle = serve(mode="colocated", pools=_pools(1), router={"port": 0, "decode_policy": "kv_aware"})
    index, hashes = handle.router.members.prefix_index, prompt_block_hashes(PREFIX, BLOCK)
    first = _complete(handle, PREFIX + SUFFIXES[0])
    wait_until(lambda: 8 in index.match(hashes).values(), timeout_s=10)
    [holder] = index.match(hashes)
    before = _prefix_hits(handle, "colocated")
    again = [_complete(handle, PREFIX + suffix) for suffix in (SUFFIXES[1], SUFFIXES[2], SUFFIXES[0])]
    assert again[2] == first  # served from the cached prefix: the same greedy text
    url = handle.base_url
    assert metric_value(url, "pdserve_routing_decisions_total", pool="colocated", reason="prefix") == 3
    assert metric_value(url, "pdserve_prefix_matched_tokens_total", pool="colocated") == 3 * len(PREFIX)
    wait_until(lambda: _prefix_hits(handle, "colocated")[holder] - before[holder] == 3 * len(PREFIX), timeout_s=10)
    assert all(hits == before[name] for name, hits in _prefix_hits(handle, "colocated").items() if name != holder)


def _complete_timing(handle, prompt: list[int]) -> tuple[str, dict]:
    body = {"model": handle.config.served_model_name, "prompt": prompt, "max_tokens": 6, "temperature": 0}
    response = httpx.post(f"{handle.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"], response.json()["timing"]


def test_decode_reservations_go_to_the_decode_worker_that_holds_the_prefix(serve):
    """With two decode workers and decode_policy kv_aware, a request whose prefix one decode worker already holds
    (a chat's next turn) reserves there, so only the blocks it lacks are reserved and shipped."""
    worker = {"torch_threads": 1, "kv_blocks": 160}
    pools = {"prefill": {"replicas": 1, **worker}, "decode": {"replicas": 2, **worker}}
    handle = serve(pools=pools, router={"port": 0, "decode_policy": "kv_aware"})
    index, hashes = handle.router.members.prefix_index, prompt_block_hashes(PREFIX, BLOCK)
    first, timing = _complete_timing(handle, PREFIX + SUFFIXES[0])
    assert timing["decode_cached_tokens"] == 0
    wait_until(lambda: any(n == 8 and w.startswith("decode") for w, n in index.match(hashes).items()), timeout_s=10)
    later = [_complete_timing(handle, PREFIX + suffix) for suffix in (*SUFFIXES[1:4], SUFFIXES[0])]
    # every later request found the 8 prefix blocks on its decode worker: only the holder has them
    assert [t["decode_cached_tokens"] for _, t in later] == [len(PREFIX)] * 4
    assert later[-1][0] == first  # the same greedy text from the reused blocks
    url = handle.base_url
    assert metric_value(url, "pdserve_routing_decisions_total", pool="decode", reason="prefix") == 4
    assert metric_value(url, "pdserve_prefix_matched_tokens_total", pool="decode") == 4 * len(PREFIX)


def test_a_prefill_worker_stops_counting_a_request_at_its_first_token(serve):
    """Load the policies weigh: a prefill worker's in-flight count covers its prefills only, not the decode after."""
    handle = serve(pools=_pools(1), router={"port": 0, "prefill_policy": "kv_aware"})
    members = handle.router.members
    body = {
        "model": handle.config.served_model_name,
        "prompt": PREFIX,
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{handle.base_url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # the first token reached the client
        assert members.get("prefill-0").inflight == 0 and members.get("decode-0").inflight == 1
        assert [line for line in lines if line][-1] == "data: [DONE]"
    wait_until(lambda: members.get("decode-0").inflight == 0, timeout_s=10)
