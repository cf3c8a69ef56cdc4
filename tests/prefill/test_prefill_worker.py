"""The prefill role, driven directly: typed commands in, typed events out, KV over the local transfer backend.

The router is played by hand (tests/helpers/roles.py): each test reserves on the decode role, sends the prefill role
its ``prefill`` command, ticks both roles' loops and reads what they emitted. Covered here: the hand-off token-exact
against one engine's ``generate`` (streamed and not, whole and chunked prompts), the first-token event's content and
timing, a command the role refuses, a prefill engine error, the router's abort in every prefill-side state and a
decode worker that is not there. Every test ends with no block, request or transfer left on either side.
"""

from __future__ import annotations

import time

import pytest

from engine.blocks import blocks_for_tokens
from engine.request import RequestStatus
from tests.helpers.engine import random_prompts
from tests.helpers.roles import assert_same_logprobs, greedy
from worker.messages import ErrorEvent, Prefill, Reserved, Tokens


@pytest.mark.parametrize("max_batch_tokens", [2048, 24], ids=["whole", "chunked"])
@pytest.mark.parametrize("stream_kv", [True, False], ids=["streamed", "unstreamed"])
def test_handoff_is_token_exact(role_pair, stream_kv, max_batch_tokens):
    pair = role_pair(stream_kv=stream_kv, prefill_engine={"max_batch_tokens": max_batch_tokens})
    pair.decode.engine.generate([[7, 8, 9] * 20], greedy(3))  # shift decode's free list: its block ids differ
    # mid-block, one token, exactly one block, on a block boundary, several blocks: prefilled together
    prompts = [p[:n] for p, n in zip(random_prompts(5, 100, 100, seed=41), [37, 1, 16, 48, 100])]
    params = greedy(14)
    rids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt in zip(rids, prompts):
        reserved = pair.reserve(rid, prompt, params)
        assert reserved.ok and len(reserved.blocks) == blocks_for_tokens(len(prompt) + 1, 16)
        pair.send_prefill(rid, prompt, params, reserved)
    pair.run_until(lambda: all(pair.prefill_events.items(rid) for rid in rids), what="first tokens")
    for rid in rids:
        pair.start(rid, pair.prefill_events.items(rid)[0])
    pair.run_until(lambda: all(pair.finished(rid) for rid in rids), what="finished")
    for rid, prompt in zip(rids, prompts):
        assert pair.client_view(rid) == pair.expected(prompt, params), rid
    for event in pair.decode_events.of(Tokens):  # one message per step, one item per request in it
        assert len({item.rid for item in event.items}) == len(event.items)
    assert pair.prefill_events.errors() == [] and pair.decode_events.errors() == []
    pair.settle()
    for role in (pair.prefill, pair.decode):
        assert role.counters.transfers_ok == len(prompts) and role.counters.transfers_failed == 0
        assert role.counters.transfer_bytes > 0
    pair.check_no_leaks()


def test_first_token_event_comes_at_once_with_its_text_and_timing(role_pair):
    pair = role_pair()
    [prompt] = random_prompts(1, 40, 40, seed=42)
    params = greedy(6)
    reserved = pair.reserve("x", prompt, params)
    sent = time.monotonic()
    pair.send_prefill("x", prompt, params, reserved, arrival_s=sent - 0.05)  # it waited 50 ms in the socket
    first = pair.wait_first_token("x", decode_too=False)  # the decode side has not taken a single piece yet
    ids, text, _ = pair.expected(prompt, params)
    [event] = [e for e in pair.prefill_events.of(Tokens) if any(item.rid == "x" for item in e.items)]
    assert event.worker == "prefill-0" and first.token_ids == ids[:1] and text.startswith(first.text)
    assert first.finish_reason is None  # a prefill worker's first token is no finish for the client
    assert first.timing.prefill_queue_s >= 0.05 and first.timing.prefill_compute_s > 0
    assert sent < first.timing.prefill_end_mono <= time.monotonic()
    # the TTFT point: the first token is out while the transfer still holds the prompt's blocks
    assert pair.prefill.engine.requests["x"].status == RequestStatus.PREFILLED
    assert pair.prefill.load().leased_transfers == 1 and pair.prefill.has_work()
    pair.start("x", first)
    pair.run_until(lambda: pair.finished("x"))
    assert pair.client_view("x") == pair.expected(prompt, params)
    # the decode side's timing goes with its first decoded token and with its finish, not in between
    timings = pair.decode_timings("x")
    assert timings[0] is not None and timings[-1] is not None and timings[0].prefill_queue_s is None
    assert all(t is None for t in timings[1:-1]) and len(timings) == 5
    decode_timing = timings[0]
    assert decode_timing.kv_transfer_s > 0 and decode_timing.kv_done_mono > first.timing.prefill_end_mono
    assert decode_timing.kv_wait_after_first_token_s >= 0 and decode_timing.decode_queue_s >= 0
    assert not decode_timing.recomputed
    pair.settle()
    pair.check_no_leaks()


def test_too_few_destination_blocks_are_refused(role_pair):
    pair = role_pair()
    [prompt] = random_prompts(1, 40, 40, seed=43)  # 3 blocks
    reserved = pair.reserve("x", prompt, greedy())
    short = Prefill(
        rid="x", prompt=prompt, params=greedy(), kv_address=reserved.kv_address, dst_blocks=reserved.blocks[:2]
    )
    with pytest.raises(ValueError, match="decode reserved 2 blocks"):  # the runtime answers invalid_request
        pair.prefill.handle(short, time.monotonic())
    assert not pair.prefill.engine.requests and pair.prefill.sender.active_transfers() == []
    pair.decode.abort("x")  # the router gives the request up on both sides
    pair.settle()
    assert pair.prefill_events.events == [] and pair.decode_events.errors() == []
    pair.check_no_leaks()


@pytest.mark.parametrize("stream_kv", [True, False], ids=["streamed", "unstreamed"])
def test_a_prefill_engine_error_is_reported_and_aborts_the_transfer(role_pair, stream_kv):
    pair = role_pair(stream_kv=stream_kv)
    prompt, other = random_prompts(2, 40, 40, seed=44)
    params = greedy(5)
    for rid in ("doomed", "other"):
        pair.send_prefill(
            rid,
            prompt if rid == "doomed" else other,
            params,
            pair.reserve(rid, prompt if rid == "doomed" else other, params),
        )

    def device_fault(layer, batch):  # the forward holding "doomed" fails (and the one holding "other" with it)
        if layer == 1 and any(c.request.request_id == "doomed" for c in batch.chunks):
            raise RuntimeError("injected device fault")

    pair.prefill.engine.set_layer_hook(device_fault)
    pair.run_until(lambda: len(pair.prefill_events.of(ErrorEvent)) == 2, what="errors")
    pair.prefill.engine.set_layer_hook(None)
    for event in pair.prefill_events.of(ErrorEvent):
        assert event.code.value == "worker_error" and "injected device fault" in event.message
    pair.settle()
    # the sender aborted both transfers: the decode side freed the reservations and stays silent about them
    assert pair.decode_events.errors() == [] and pair.decode_events.of(Tokens) == []
    assert pair.prefill.counters.errors == 2 and pair.prefill.counters.transfers_failed == 2
    assert pair.decode.counters.transfers_failed == 2
    assert len(pair.prefill_events.of(ErrorEvent)) == 2  # the aborted transfers are not reported again
    pair.check_no_leaks()


@pytest.mark.parametrize("state", ["queued", "computing", "leased"])
def test_a_router_abort_frees_the_prefill_side_in_every_state(role_pair, state):
    pair = role_pair(prefill_engine={"max_batch_tokens": 32})
    [prompt] = random_prompts(1, 100, 100, seed=45)  # four chunks
    params = greedy(6)
    pair.send_prefill("x", prompt, params, pair.reserve("x", prompt, params))
    if state == "computing":
        pair.prefill.tick()  # one chunk computed, its two blocks streamed
        assert pair.prefill.engine.requests["x"].kv_export.num_blocks_reported == 2
    elif state == "leased":
        pair.wait_first_token("x", decode_too=False)
    pair.prefill.abort("x")
    pair.run_until(lambda: not pair.prefill.engine.requests and not pair.decode.receiver.pending_transfers())
    assert pair.prefill_events.errors() == []  # the router knows: nothing more is reported
    if state == "leased":  # the whole KV was sent before the abort: the decode side has it, and waits
        assert pair.decode.engine.requests["x"].kv_import.kv_done_s is not None
    else:  # the sender aborted: the decode side frees the reservation at once, silently
        assert "x" not in pair.decode.engine.requests and pair.decode.counters.transfers_failed == 1
    pair.decode.abort("x")  # the router aborts both sides
    pair.settle()
    assert pair.decode_events.errors() == [] and pair.decode_events.of(Tokens) == []
    pair.check_no_leaks()


def test_a_decode_worker_that_is_not_there_is_reported_by_the_prefill_side(role_pair):
    pair = role_pair()
    [prompt] = random_prompts(1, 20, 20, seed=46)
    gone = Reserved(rid="x", worker="decode-9", ok=True, blocks=[0, 1], kv_address="local://nobody")
    pair.send_prefill("x", prompt, greedy(), gone)
    pair.settle()
    # a failure this side decided: reported from here, once, and the request's blocks are freed
    assert pair.prefill_events.errors() == [("x", "kv_transfer_failed")]
    assert "no local receiver" in pair.prefill_events.of(ErrorEvent)[0].message
    assert pair.prefill.counters.transfers_failed == 1
    pair.check_no_leaks()


def test_fail_all_frees_every_prefill_request(role_pair):
    pair = role_pair(prefill_engine={"max_batch_tokens": 32})
    prompts = random_prompts(2, 60, 60, seed=47)
    for rid, prompt in zip(("a", "b"), prompts):
        pair.send_prefill(rid, prompt, greedy(), pair.reserve(rid, prompt, greedy()))
    pair.wait_first_token("a", decode_too=False)  # "a" is leased, "b" is computing or queued
    pair.prefill.fail_all("worker step failed")
    assert sorted(pair.prefill_events.errors()) == [("a", "worker_error"), ("b", "worker_error")]
    for rid in ("a", "b"):
        pair.decode.abort(rid)  # the router fails the requests on both sides
    pair.settle()
    assert sorted(pair.prefill_events.errors()) == [("a", "worker_error"), ("b", "worker_error")]
    pair.check_no_leaks()


# ---- prefix reuse: only the blocks the decode worker lacks ---------------------------------------------------------


def _record_sends(pair) -> list[tuple[str, int, list[int]]]:
    """Every piece the prefill role hands its sender: (transfer id, layer, destination blocks); still sent."""
    sender, sent = pair.prefill.sender, []
    original = sender.send_layer

    def send_layer(tid, layer, dst, k, v):
        sent.append((tid, layer, list(dst)))
        return original(tid, layer, dst, k, v)

    sender.send_layer = send_layer
    return sent


@pytest.mark.parametrize("max_batch_tokens", [2048, 24], ids=["whole", "chunked"])
@pytest.mark.parametrize("stream_kv", [True, False], ids=["streamed", "unstreamed"])
def test_only_the_blocks_after_cached_tokens_are_computed_for_the_decode_worker_and_sent(
    role_pair, stream_kv, max_batch_tokens
):
    pair = role_pair(stream_kv=stream_kv, prefill_engine={"max_batch_tokens": max_batch_tokens})
    history, user = random_prompts(2, 50, 50, seed=48)
    params = greedy(20)
    pair.handoff("t1", history, params)
    pair.settle()
    sent = _record_sends(pair)
    # the next turn: the decode role holds the history it decoded (4 blocks), this engine only the prompt (3)
    prompt = history + pair.client_view("t1")[0] + user[:20]  # 90 tokens: 6 blocks
    reserved = pair.reserve("t2", prompt, params)
    assert reserved.cached_tokens == 64 and reserved.ok
    pair.send_prefill("t2", prompt, params, reserved)
    pair.start("t2", pair.wait_first_token("t2"))
    pair.run_until(lambda: pair.finished("t2"))
    assert pair.client_view("t2") == pair.expected(prompt, params)
    missing = pair.decode.engine.block_manager.blocks_for(len(prompt)) - 4
    assert {tid for tid, _, _ in sent} == {"t2"}
    for layer in range(pair.prefill.engine.kv_spec.num_layers):
        blocks = [b for _, lyr, dst in sent if lyr == layer for b in dst]
        assert blocks == reserved.blocks[:missing], layer  # each missing block once, in order
    # this engine computed everything after what it held itself (the decode worker's cache saves it nothing)
    assert pair.prefill.engine.block_manager.prefix_hit_tokens == 48
    pair.settle()
    pair.check_no_leaks()


def test_cached_tokens_must_be_whole_blocks_inside_the_prompt(role_pair):
    pair = role_pair()
    [prompt] = random_prompts(1, 40, 40, seed=49)
    reserved = pair.reserve("x", prompt, greedy())
    for cached, match in ((8, "multiple of the block size"), (48, "multiple of the block size"), (32, "needs more")):
        bad = Prefill(
            rid="x",
            prompt=prompt,
            params=greedy(),
            kv_address=reserved.kv_address,
            dst_blocks=[] if cached == 32 else reserved.blocks,
            cached_tokens=cached,
        )
        with pytest.raises(ValueError, match=match):  # the runtime answers invalid_request
            pair.prefill.handle(bad, time.monotonic())
        assert not pair.prefill.engine.requests and pair.prefill.sender.active_transfers() == []
    pair.decode.abort("x")
    pair.settle()
    assert pair.prefill_events.events == [] and pair.decode_events.errors() == []
    pair.check_no_leaks()


@pytest.mark.parametrize("stream_kv", [True, False], ids=["streamed", "unstreamed"])
def test_the_first_token_carries_its_logprobs_the_prompts_and_the_prefix_cache_hit(role_pair, stream_kv):
    """Needs the engine's logprobs (issue 14). The prefill role computes the prompt, so the prompt's logprobs and
    the first token's come from here, with the prompt tokens its own prefix cache spared; the decode role sends one
    entry per later token and none of the prompt's: together, one engine's figures."""
    pair = role_pair(stream_kv=stream_kv)
    [prompt] = random_prompts(1, 40, 40, seed=50)  # two full blocks of 16 and a partial one
    params = greedy(6, logprobs=3, prompt_logprobs=2)
    first, items = pair.handoff("a", prompt, params)
    expected = pair.expected_outputs(prompt, params)
    [logprob] = first.logprobs
    assert logprob.token_id == first.token_ids[0] and len(logprob.top) == 3
    assert first.prompt_logprobs[0] is None and [lp.token_id for lp in first.prompt_logprobs[1:]] == prompt[1:]
    assert_same_logprobs(first.prompt_logprobs, expected[0].prompt_logprobs)
    assert first.cached_tokens == 0
    assert_same_logprobs(pair.client_logprobs("a"), [lp for output in expected for lp in output.logprobs or []])
    assert all(item.prompt_logprobs is None and item.cached_tokens is None for item in items)
    # the same prompt again, without logprobs: its full blocks come from this engine's prefix cache
    first, items = pair.handoff("b", prompt, greedy(4))
    assert (first.logprobs, first.prompt_logprobs, first.cached_tokens) == (None, None, 32)
    assert all(item.logprobs is None for item in items)
    pair.settle()
    pair.check_no_leaks()
