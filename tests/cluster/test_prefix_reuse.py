"""Through HTTP: prefix reuse across the hand-off and conditional disaggregation, on a tiny in-process cluster.

A chat's next turn sends the whole history; the decode worker that decoded the last turn holds it in its prefix
cache, so it reserves, and the prefill worker sends, only the blocks it lacks. A prompt whose uncached part is at
most ``router.local_prefill_max_tokens`` is prefilled on the decode worker itself. Either way the client gets what
one engine's ``generate`` gives, and nothing is left held (the ``serve`` fixture checks every worker at the end).
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import SamplingParams
from tests.helpers.cluster import metric_value, wait_until, worker_named
from tests.helpers.engine import random_prompts
from worker.messages import KvEvents, Reserved

pytestmark = pytest.mark.timeout(240)

MAX_TOKENS = 20


@pytest.fixture(scope="module")
def reference(tiny_llama_path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_llama_path), kv_blocks=256))


def _expected(reference: LLMEngine, prompt: list[int], max_tokens: int = MAX_TOKENS) -> tuple[list[int], str]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    [result] = reference.generate([prompt], params)
    return result.token_ids, result.text


def _complete(handle, prompt: list[int], max_tokens: int = MAX_TOKENS, **extra) -> httpx.Response:
    body = {
        "model": handle.config.served_model_name,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }
    return httpx.post(f"{handle.base_url}/v1/completions", json=body, timeout=60)


def _spy_commands(worker) -> list:
    """Every command the worker's loop handles from now on (it still handles them)."""
    seen, original = [], worker.role.handle

    def handle(command, arrival_s):
        seen.append(command)
        return original(command, arrival_s)

    worker.role.handle = handle
    return seen


def test_a_three_turn_chat_is_token_exact_and_later_turns_ship_fewer_bytes(serve, reference):
    handle = serve()
    decode = worker_named(handle, "decode-0")
    history, *users = random_prompts(3, 60, 60, seed=70)
    bytes_per_turn, cached_per_turn = [], []
    prompt, ids = history, []
    for turn in range(3):
        if turn:  # the whole history: the last prompt, the reply the client got, the user's new tokens
            prompt = prompt + ids + users[turn - 1][:8]
        ids, text = _expected(reference, prompt)
        before = decode.role.counters.transfer_bytes
        response = _complete(handle, prompt)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["choices"][0]["text"] == text, turn
        assert body["usage"]["completion_tokens"] == MAX_TOKENS
        bytes_per_turn.append(decode.role.counters.transfer_bytes - before)  # DONE before the request decoded
        cached_per_turn.append(int(body["timing"]["decode_cached_tokens"]))
    # turn 1: 60 tokens, nothing held; later turns: the decode worker holds the history it decoded, all but the last
    # generated token (whose KV is never computed), in whole blocks
    assert cached_per_turn == [0, (60 + MAX_TOKENS - 1) // 16 * 16, (88 + MAX_TOKENS - 1) // 16 * 16]
    assert 0 < bytes_per_turn[1] < bytes_per_turn[0] and 0 < bytes_per_turn[2] < bytes_per_turn[0], bytes_per_turn
    assert metric_value(handle.base_url, "pdserve_decode_cached_prompt_tokens_total") == sum(cached_per_turn)
    assert metric_value(handle.base_url, "pdserve_prefill_path_total", path="remote") == 3
    assert metric_value(handle.base_url, "pdserve_prefill_path_total", path="local") == 0


def test_short_uncached_parts_are_prefilled_on_the_decode_worker(serve, reference):
    handle = serve(router={"local_prefill_max_tokens": 24})
    decode, prefill = worker_named(handle, "decode-0"), worker_named(handle, "prefill-0")
    to_prefill = _spy_commands(prefill)
    short, long_, user = random_prompts(3, 20, 20, seed=71)
    long_ = long_ * 5  # 100 tokens
    second_turn = long_ + _expected(reference, long_)[0] + user[:4]  # 124 tokens; 112 held after the first turn
    for prompt, path in ((short, "local"), (long_, "remote"), (second_turn, "local")):
        response = _complete(handle, prompt)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["choices"][0]["text"] == _expected(reference, prompt)[1], path
        assert body["timing"].get("prefill_local") == (1.0 if path == "local" else None)
        assert body["timing"]["prefill_compute_s"] > 0  # from the decode worker on the local path
    assert [type(c).__name__ for c in to_prefill] == ["Prefill"]  # the long prompt only
    assert decode.role.counters.local_prefills == 2 and decode.role.counters.transfers_ok == 1
    assert metric_value(handle.base_url, "pdserve_prefill_path_total", path="local") == 2
    assert metric_value(handle.base_url, "pdserve_prefill_path_total", path="remote") == 1
    time.sleep(0.3)  # one more heartbeat reaches the router's gauges
    assert metric_value(handle.base_url, "pdserve_worker_total", worker="decode-0", key="local_prefills") == 2


def test_a_chats_next_turn_finds_its_decode_worker_before_the_kv_events_and_is_prefilled_there(serve, reference):
    """Two decode workers, kv_aware: the router records at dispatch that the chosen decode worker will hold the prompt
    (``PrefixIndex.expect``), so with every KV event held back (late), each later turn still reserves on the worker
    that decoded the chat; what that worker lacks (the user's new tokens, not the answer it generated) is short, so it
    prefills it itself: no prefill worker, no transfer, token-exact."""
    worker = {"torch_threads": 1, "kv_blocks": 160}
    pools = {"prefill": {"replicas": 1, **worker}, "decode": {"replicas": 2, **worker}}
    router_section = {"decode_policy": "kv_aware", "prefill_policy": "kv_aware", "local_prefill_max_tokens": 24}
    handle = serve(pools=pools, router=router_section)
    router = handle.router
    held: list = []
    original = router.on_event
    router.on_event = lambda event: held.append(event) if isinstance(event, KvEvents) else original(event)  # delayed
    decoders = [worker_named(handle, f"decode-{i}") for i in range(2)]
    history, *users = random_prompts(3, 60, 60, seed=74)
    prompt, ids, cached = history, [], []
    for turn in range(3):
        if turn:
            prompt = prompt + ids + users[turn - 1][:8]
        ids, text = _expected(reference, prompt)
        response = _complete(handle, prompt)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["choices"][0]["text"] == text, turn
        assert body["timing"].get("prefill_local") == (1.0 if turn else None), turn
        cached.append(int(body["timing"]["decode_cached_tokens"]))
    url = handle.base_url
    assert held and metric_value(url, "pdserve_kv_events_total", kind="delta") in (None, 0)  # none applied yet
    [holder] = [d for d in decoders if d.role.counters.transfers_ok]
    assert holder.role.counters.local_prefills == 2  # both later turns on the worker that holds the chat
    assert sum(d.role.counters.local_prefills + d.role.counters.transfers_ok for d in decoders) == 3
    assert cached == [0, (60 + MAX_TOKENS - 1) // 16 * 16, (88 + MAX_TOKENS - 1) // 16 * 16]
    assert metric_value(url, "pdserve_routing_decisions_total", pool="decode", reason="prefix") == 2

    def deliver() -> None:
        router.on_event = original
        for event in held:
            original(event)

    router._call_threadsafe(deliver)


def test_a_local_stream_sends_its_first_token_from_the_decode_worker(serve, reference):
    handle = serve(router={"local_prefill_max_tokens": 64})
    [prompt] = random_prompts(1, 30, 30, seed=72)
    body = {
        "model": handle.config.served_model_name,
        "prompt": prompt,
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    response = httpx.post(f"{handle.base_url}/v1/completions", json=body, timeout=60)
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == _expected(reference, prompt, 12)[1]
    assert metric_value(handle.base_url, "pdserve_prefill_path_total", path="local") == 1
    assert metric_value(handle.base_url, "pdserve_ttft_seconds_count") == 1


@pytest.mark.parametrize("end", ["client_gone", "decode_marked_dead", "answer_lost"])
def test_the_local_path_frees_everything_however_it_ends(serve, end):
    router_section = {"local_prefill_max_tokens": 64, "worker_timeout_s": 1}
    handle = serve(router=router_section, transfer={"deadline_s": 1, "lease_s": 20})
    decode = worker_named(handle, "decode-0")
    if end == "answer_lost":  # the worker started prefilling with its answer, which never reaches the router
        on_event, lost = handle.router.on_event, []
        handle.router.on_event = lambda event: (
            lost.append(event) if isinstance(event, Reserved) and not lost else on_event(event)
        )
    [prompt] = random_prompts(1, 30, 30, seed=73)
    body = {
        "model": handle.config.served_model_name,
        "prompt": prompt,
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    lines, raw = [], []
    with httpx.stream("POST", f"{handle.base_url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            raw.append(line)
            if line.startswith("data: "):
                lines.append(line[6:])
            if end == "client_gone" and len(lines) == 3:
                break  # a few tokens arrived; now the client goes away
            if end == "decode_marked_dead" and len(lines) == 3:
                handle.router.mark_dead_threadsafe("decode-0", "monitor: process gone")  # a false alarm
    if end == "decode_marked_dead":  # tokens were streamed: an error event ends the stream, no retry
        errors = [json.loads(e)["error"] for e in lines if e != "[DONE]" and "error" in json.loads(e)]
        assert [e["code"] for e in errors] == ["worker_died"] and lines[-1] == "[DONE]", lines
    elif end == "answer_lost":  # after worker_timeout_s the router asks again: the worker's new reservation
        # replaces the local prefill the lost answer started, and the client gets one whole completion
        assert response.status_code == 200 and lines[-1] == "[DONE]", raw
        events = [json.loads(e) for e in lines[:-1]]
        assert not [e for e in events if "error" in e] and events[-1]["choices"][0]["finish_reason"] == "length"
        assert len(lost) == 1 and lost[0].prefill_local
    wait_until(lambda: not decode.engine.requests, 5)  # the worker freed it (the fixture checks every block)
    if end == "decode_marked_dead":
        wait_until(lambda: handle.router.members.workers["decode-0"].alive, 3)  # its next heartbeat revives it
    counters = decode.role.counters
    assert counters.local_prefills == (2 if end == "answer_lost" else 1)
    assert counters.transfers_failed + counters.reservations_expired == 0
