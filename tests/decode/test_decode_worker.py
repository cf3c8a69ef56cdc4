"""The decode role, driven directly: typed commands in, typed events out, KV over the local transfer backend.

The router is played by hand (tests/helpers/roles.py). Covered here: reservations (refused when the blocks are not
free, never overcommitted; each attempt under its own wire id, undone by an ``abort`` of that id only), the first
token and the KV arriving in either order, a failed transfer under each failure policy, the router's abort in every
decode-side state, a reservation whose first token never comes, and failing everything at once. Every test ends with
no block, request or transfer left on either side.
"""

from __future__ import annotations

import time

import msgspec
import pytest

from engine.blocks import reserved_blocks
from engine.request import RequestStatus
from tests.helpers.engine import random_prompts
from tests.helpers.roles import assert_same_logprobs, build_engine, greedy
from transfer.config import TransferConfig
from transfer.wire import ModelFingerprint
from worker.messages import ErrorEvent, Start, Timing, Tokens
from worker.rank_kv import shared_kv_cache
from worker.spec import RuntimeOptions, WorkerSpec


def _drop_layer(pair, layer: int) -> None:
    """Lose every KV piece of one layer on its way to the decode role (the sender believes it sent them)."""
    sender = pair.prefill.sender
    original = sender.send_layer

    def send_layer(tid, lyr, dst, k, v):
        return True if lyr == layer else original(tid, lyr, dst, k, v)

    sender.send_layer = send_layer


# ---- reservations ------------------------------------------------------------------------------------------------


def test_a_reservation_is_refused_when_the_blocks_are_not_free(role_pair):
    pair = role_pair(decode_engine={"kv_blocks": 8}, headroom_tokens=16)
    big, small = list(range(100)), list(range(40))
    first = pair.reserve("a", big, greedy(4))  # 100 + 1 + 3 (headroom capped by max_tokens) tokens: 7 blocks
    assert first.ok and len(first.blocks) == reserved_blocks(100, 4, 16, 16) == 7
    refused = pair.reserve("b", small, greedy(40))  # 40 + 1 + 16 tokens: 4 blocks, 1 free
    assert not refused.ok and refused.reason == "kv_full" and refused.blocks == []
    assert pair.decode.counters.reservations_refused == 1 and "b" not in pair.decode.engine.requests
    assert pair.decode.engine.num_free_blocks == 1  # never overcommitted
    assert pair.decode.load().awaiting_kv == 1 and pair.decode.receiver.pending_transfers() == ["a"]
    pair.decode.abort("a")
    assert pair.reserve("b", small, greedy(40)).ok  # room again
    pair.decode.abort("b")
    pair.settle()
    assert pair.decode_events.errors() == []
    pair.check_no_leaks()


def test_each_attempt_is_a_reservation_of_its_own_and_an_abort_undoes_only_its_own(role_pair):
    """The router asks again under a new wire id when an answer came too late; the late one's ``abort`` frees its
    blocks only, never the reservation the router went on with."""
    pair = role_pair()
    [prompt] = random_prompts(1, 40, 40, seed=51)
    first = pair.reserve("x", prompt, greedy())
    again = pair.reserve("x.1", prompt, greedy())  # the router asks again: our answer came too late
    assert first.ok and again.ok and set(first.blocks).isdisjoint(again.blocks)
    assert sorted(pair.decode.receiver.pending_transfers()) == ["x", "x.1"]
    pair.decode.abort("x")  # (the runtime's answer to Abort) the late answer to the first attempt is undone...
    assert "x" not in pair.decode.engine.requests and "x.1" in pair.decode.engine.requests  # ...the second stays
    with pytest.raises(ValueError, match="already in use"):  # one id for two reservations is a router bug
        pair.reserve("x.1", prompt[:20], greedy())
    pair.decode.abort("x.1")
    pair.settle()
    assert pair.decode_events.errors() == []
    pair.check_no_leaks()


def test_a_start_or_an_abort_for_no_reservation(role_pair):
    pair = role_pair()
    with pytest.raises(KeyError, match="no reservation"):  # the runtime answers invalid_request
        pair.decode.handle(Start(rid="nobody", tokens=[1]), time.monotonic())
    pair.decode.abort("nobody")  # nothing to undo
    assert pair.decode_events.events == []
    pair.check_no_leaks()


# ---- the first token and the KV, in either order -------------------------------------------------------------------


@pytest.mark.parametrize("order", ["kv_first", "start_first"])
def test_start_and_kv_in_either_order_is_token_exact(role_pair, order):
    pair = role_pair(headroom_tokens=8)
    prompt, other = random_prompts(2, 30, 50, seed=53)
    params = greedy(10)
    pair.send_prefill("other", other, greedy(30), pair.reserve("other", other, greedy(30)))
    pair.start("other", pair.wait_first_token("other"))  # decoding here while "x" arrives
    reserved = pair.reserve("x", prompt, params)
    pair.send_prefill("x", prompt, params, reserved)
    first = pair.wait_first_token("x", decode_too=False)  # the KV waits in the receiver, unpolled
    request = pair.decode.engine.requests["x"]
    if order == "kv_first":
        pair.run_until(lambda: request.kv_import.kv_done_s is not None, what="KV done")
        for _ in range(3):  # half of what admission needs: the request waits, the batch goes on without it
            pair.tick()
            assert request.status == RequestStatus.WAITING_FOR_REMOTE_KV and not pair.decode_events.items("x")
        time.sleep(0.002)
        pair.start("x", first)
    else:
        pair.start("x", first)
        time.sleep(0.002)  # the first token waits for the KV this long at least
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KV
    pair.run_until(lambda: pair.finished("x") and pair.finished("other"))
    assert pair.client_view("x") == pair.expected(prompt, params)
    assert pair.client_view("other") == pair.expected(other, greedy(30))
    timing = pair.decode_timings("x")[0]
    assert isinstance(timing, Timing) and timing.kv_transfer_s > 0 and not timing.recomputed
    if order == "kv_first":
        assert timing.kv_wait_after_first_token_s == 0.0
    else:
        assert timing.kv_wait_after_first_token_s >= 0.002
    assert pair.decode_events.errors() == [] and pair.prefill_events.errors() == []
    pair.settle()
    pair.check_no_leaks()


def test_a_request_that_finishes_with_its_first_token(role_pair):
    pair = role_pair()
    [prompt] = random_prompts(1, 33, 33, seed=54)
    _, items = pair.handoff("one", prompt, greedy(1))
    assert [(i.token_ids, i.finish_reason.value) for i in items] == [([], "length")]  # no token of its own
    assert items[0].timing is not None and items[0].timing.kv_transfer_s > 0
    assert pair.client_view("one") == pair.expected(prompt, greedy(1))
    pair.settle()
    pair.check_no_leaks()


def test_a_handoff_onto_a_compiled_decode_step_is_token_exact_and_counted(role_pair):
    """A decode worker whose engine compiled its decode step (``compile_decode_batches``) decodes the handed-off
    request on it, token for token as the eager engine, and its totals say so (``/metrics``)."""
    pair = role_pair(decode_engine=dict(compile_decode_batches=[1], compile_decode_background=False))
    [prompt] = random_prompts(1, 30, 30, seed=71)
    pair.handoff("c", prompt, greedy(12))
    assert pair.client_view("c") == pair.expected(prompt, greedy(12))
    totals = pair.decode.totals()
    assert totals.static_decode_steps >= 10 and totals.decode_compile_seconds > 0
    assert pair.prefill.totals().static_decode_steps == 0  # the prefill engine has no static steps
    pair.settle()
    pair.check_no_leaks()


# ---- a failed transfer ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("when", ["before_start", "after_start"])
def test_a_failed_transfer_under_policy_fail_is_reported_by_the_decode_side(role_pair, when):
    pair = role_pair(failure_policy="fail")
    [prompt] = random_prompts(1, 45, 45, seed=55)
    params = greedy(8)
    _drop_layer(pair, layer=1)
    pair.send_prefill("x", prompt, params, pair.reserve("x", prompt, params))
    first = pair.wait_first_token("x", decode_too=False)
    if when == "after_start":
        pair.start("x", first)
    pair.settle()
    assert pair.decode_events.errors() == [("x", "kv_transfer_failed")]
    assert "never sent" in pair.decode_events.of(ErrorEvent)[0].message
    assert pair.prefill_events.errors() == []  # the NACK's failure is the decode side's to report, not both
    assert pair.decode_events.of(Tokens) == []
    assert pair.decode.counters.transfers_failed == 1 and pair.prefill.counters.transfers_failed == 1
    assert pair.decode.totals().recomputes == 0
    if when == "before_start":  # the router's start comes after the failure: the request is gone
        with pytest.raises(KeyError):
            pair.start("x", first)
    pair.check_no_leaks()


@pytest.mark.parametrize("when", ["before_start", "after_start"])
def test_a_failed_transfer_under_policy_recompute_is_token_exact(role_pair, when):
    pair = role_pair(failure_policy="recompute")
    [prompt] = random_prompts(1, 45, 45, seed=56)
    params = greedy(10)
    _drop_layer(pair, layer=0)
    pair.send_prefill("x", prompt, params, pair.reserve("x", prompt, params))
    first = pair.wait_first_token("x", decode_too=False)
    if when == "after_start":
        pair.start("x", first)
    pair.run_until(lambda: pair.decode.counters.transfers_failed == 1, what="the transfer failed")
    if when == "before_start":  # the reserved blocks are freed at once; the recompute waits for the first token
        assert pair.decode.engine.num_free_blocks == pair.decode.engine.block_manager.num_blocks
        assert pair.decode.engine.requests["x"].status == RequestStatus.WAITING_FOR_REMOTE_KV
        pair.start("x", first)
    pair.run_until(lambda: pair.finished("x"))
    assert pair.client_view("x") == pair.expected(prompt, params)
    assert pair.decode_events.errors() == [] and pair.prefill_events.errors() == []
    assert pair.decode.totals().recomputes == 1
    timing = pair.decode_timings("x")[0]
    assert timing.recomputed and timing.kv_transfer_s is None and timing.decode_queue_s >= 0
    pair.settle()
    pair.check_no_leaks()


# ---- the router's abort, expiry, failing everything ----------------------------------------------------------------

DECODE_STATES = ["reserved", "kv_arriving", "kv_done", "started", "decoding", "failed_awaiting_start"]


@pytest.mark.parametrize("state", DECODE_STATES)
def test_a_router_abort_frees_the_decode_side_in_every_state(role_pair, state):
    pair = role_pair(
        failure_policy="recompute" if state == "failed_awaiting_start" else "fail",
        prefill_engine={"max_batch_tokens": 32},
    )
    [prompt] = random_prompts(1, 100, 100, seed=57)  # four prefill chunks
    params = greedy(30)
    reserved = pair.reserve("x", prompt, params)
    request = pair.decode.engine.requests["x"]
    if state != "reserved":
        if state == "failed_awaiting_start":
            _drop_layer(pair, layer=2)
        pair.send_prefill("x", prompt, params, reserved)
    if state == "kv_arriving":
        pair.tick()  # one chunk: two blocks of every layer written, the rest still computing
        assert request.kv_import.kv_done_s is None and "x" in pair.prefill.engine.requests
    elif state in ("kv_done", "failed_awaiting_start"):
        pair.wait_first_token("x")
        handoff = request.kv_import
        pair.run_until(lambda: handoff.kv_done_s is not None or handoff.kv_failed_s is not None)
        assert (handoff.kv_failed_s is not None) == (state == "failed_awaiting_start")
    elif state == "started":
        pair.start("x", pair.wait_first_token("x", decode_too=False))
        assert request.kv_import.kv_done_s is None
    elif state == "decoding":
        pair.start("x", pair.wait_first_token("x"))
        pair.run_until(lambda: len(pair.decode_events.items("x")) >= 3, what="decoding")
    pair.decode.abort("x")
    pair.prefill.abort("x")  # the router aborts both sides (the prefill side may have let it go already)
    tokens_before = len(pair.decode_events.items("x"))
    pair.settle()
    assert pair.decode_events.errors() == [] and pair.prefill_events.errors() == []
    assert len(pair.decode_events.items("x")) == tokens_before  # nothing more about it after the abort
    assert not any(item.finish_reason for item in pair.decode_events.items("x"))
    pair.check_no_leaks()


def test_a_decode_side_abort_alone_stops_the_prefill(role_pair):
    pair = role_pair(prefill_engine={"max_batch_tokens": 32})
    [prompt] = random_prompts(1, 100, 100, seed=58)
    pair.send_prefill("x", prompt, greedy(), pair.reserve("x", prompt, greedy()))
    pair.tick()  # one chunk of four computed and streamed
    pair.decode.abort("x")  # the receiver NACKs the transfer: the prefill side stops computing, silently
    pair.settle()
    assert pair.prefill_events.of(Tokens) == [] and pair.prefill_events.errors() == []
    assert pair.decode_events.errors() == [] and pair.prefill.counters.transfers_failed == 1
    pair.check_no_leaks()


@pytest.mark.parametrize("state", ["no_prefill", "kv_done", "kv_failed_to_recompute"])
def test_a_reservation_without_a_first_token_expires(role_pair, state):
    pair = role_pair(start_deadline_s=0.3, failure_policy="recompute" if state == "kv_failed_to_recompute" else "fail")
    [prompt] = random_prompts(1, 40, 40, seed=59)
    params = greedy()
    reserved = pair.reserve("x", prompt, params)
    first = None
    if state != "no_prefill":
        if state == "kv_failed_to_recompute":
            _drop_layer(pair, layer=1)
        pair.send_prefill("x", prompt, params, reserved)
        first = pair.wait_first_token("x")
    pair.run_until(lambda: pair.decode_events.of(ErrorEvent), timeout_s=5, what="expiry")
    assert pair.decode_events.errors() == [("x", "reservation_expired")]
    assert "within 0 s" in pair.decode_events.of(ErrorEvent)[0].message
    assert pair.decode.counters.reservations_expired == 1 and "x" not in pair.decode.engine.requests
    if first is not None:
        with pytest.raises(KeyError):  # the router's start, too late
            pair.start("x", first)
    pair.settle()
    assert pair.decode_events.errors() == [("x", "reservation_expired")] and pair.prefill_events.errors() == []
    pair.check_no_leaks()


def test_fail_all_frees_every_decode_request(role_pair):
    pair = role_pair()
    prompts = random_prompts(3, 30, 30, seed=60)
    for rid, prompt in zip(("reserved", "kv_done", "decoding"), prompts):
        reserved = pair.reserve(rid, prompt, greedy(40))
        if rid != "reserved":
            pair.send_prefill(rid, prompt, greedy(40), reserved)
    pair.start("decoding", pair.wait_first_token("decoding"))
    pair.wait_first_token("kv_done")
    pair.run_until(lambda: len(pair.decode_events.items("decoding")) >= 2)
    pair.decode.fail_all("worker step failed")
    assert sorted(pair.decode_events.errors()) == [(rid, "worker_error") for rid in ("decoding", "kv_done", "reserved")]
    pair.settle()
    assert len(pair.decode_events.errors()) == 3
    pair.check_no_leaks()


# ---- prefix reuse and prefill on the decode worker (conditional disaggregation) -----------------------------------


def _next_turn(pair, rid: str, history: list[int], user: list[int], params) -> list[int]:
    """The prompt of a chat's next turn: the last prompt, the reply the client got for it, the user's new tokens."""
    return history + pair.client_view(rid)[0] + user


def test_a_chats_next_turn_reserves_and_receives_only_the_missing_blocks(role_pair):
    pair = role_pair(headroom_tokens=8)
    history, user = random_prompts(2, 40, 40, seed=64)
    params = greedy(30)
    pair.handoff("t1", history, params)
    pair.settle()
    bytes_t1 = pair.decode.counters.transfer_bytes
    prompt = _next_turn(pair, "t1", history, user[:5], params)  # 75 tokens: 5 blocks, the first 4 held here
    reserved = pair.reserve("t2", prompt, params)
    assert reserved.ok and reserved.cached_tokens == (40 + 30 - 1) // 16 * 16 == 64
    assert len(reserved.blocks) == reserved_blocks(len(prompt), 30, 8, 16) - 4  # only the new blocks are reserved
    assert pair.decode.receiver.pending_transfers() == ["t2"]
    pair.send_prefill("t2", prompt, params, reserved)
    pair.start("t2", pair.wait_first_token("t2"))
    pair.run_until(lambda: pair.finished("t2"), what="t2 finished")
    assert pair.client_view("t2") == pair.expected(prompt, params)
    pair.settle()
    bytes_t2 = pair.decode.counters.transfer_bytes - bytes_t1
    # 1 block instead of 3 (the bytes per block are the same: the wire adds a fixed header per piece)
    assert 0 < bytes_t2 < bytes_t1 / 2 and pair.prefill.counters.transfer_bytes == bytes_t1 + bytes_t2
    assert pair.decode.counters.transfers_ok == 2 and pair.decode_events.errors() == []
    pair.check_no_leaks()


@pytest.mark.parametrize("max_batch_tokens", [2048, 8], ids=["whole", "chunked"])
def test_a_local_prefill_decodes_on_the_decode_worker_with_no_transfer(role_pair, max_batch_tokens):
    pair = role_pair(decode_engine={"max_batch_tokens": max_batch_tokens})
    history, cold, user = random_prompts(3, 35, 35, seed=65)
    params = greedy(12)
    pair.handoff("t1", history, params)
    pair.settle()
    counters_before = msgspec.structs.replace(pair.decode.counters)
    warm = _next_turn(pair, "t1", history, user[:6], params)
    for rid, prompt in (("cold", cold), ("warm", warm)):
        reserved = pair.local(rid, prompt, params)
        assert reserved.cached_tokens == (0 if rid == "cold" else (35 + 12 - 1) // 16 * 16)
        assert pair.client_view(rid) == pair.expected(prompt, params), rid
        items = pair.decode_events.items(rid)
        assert items[0].token_ids and items[0].timing.prefill_compute_s > 0  # the first token is its own
        assert items[-1].timing.prefill_compute_s > 0 and items[-1].timing.kv_transfer_s is None
    pair.settle()
    assert pair.prefill_events.items("cold") == [] and not pair.prefill.engine.block_manager.prefix_hit_tokens
    counters = pair.decode.counters
    assert counters.local_prefills == 2 and counters.transfer_bytes == counters_before.transfer_bytes
    assert counters.transfers_ok == counters_before.transfers_ok and counters.transfers_failed == 0
    assert pair.decode_events.errors() == []
    pair.check_no_leaks()


@pytest.mark.parametrize("end", ["abort_prefilling", "abort_decoding", "fail_all", "past_the_start_deadline"])
def test_the_local_path_frees_everything_however_it_ends(role_pair, end):
    pair = role_pair(decode_engine={"max_batch_tokens": 16})
    history, user = random_prompts(2, 60, 60, seed=67)
    params = greedy(20)
    pair.handoff("t1", history, params)
    pair.settle()
    pair.decode.start_deadline_s = 0.2  # a reservation without a first token expires after this (a short test)
    prompt = _next_turn(pair, "t1", history, user, params)  # 140 tokens, 64 cached: five chunks of 16 here
    reserved = pair.reserve("x", prompt, params, local_max=len(prompt))
    assert reserved.cached_tokens == 64 and reserved.prefill_local
    request = pair.decode.engine.requests["x"]
    if end == "abort_prefilling":
        pair.tick()
        assert 64 < request.num_computed_tokens < len(prompt) and not pair.decode_events.items("x")
        pair.decode.abort("x")
    elif end == "abort_decoding":
        pair.run_until(lambda: len(pair.decode_events.items("x")) >= 3, what="decoding")
        pair.decode.abort("x")
    elif end == "fail_all":
        pair.tick()
        pair.decode.fail_all("worker step failed")
        assert pair.decode_events.errors() == [("x", "worker_error")]
    else:  # a running request is no reservation: the expiry of reservations without a first token leaves it be
        time.sleep(0.6)  # past the deadline and the interval of the expiry check: the next tick checks
        pair.run_until(lambda: pair.finished("x"))
        assert pair.client_view("x") == pair.expected(prompt, params)
        assert pair.decode.counters.reservations_expired == 0
    pair.settle()
    assert pair.decode.counters.transfers_failed == 0 and pair.prefill.engine.requests == {}
    if end != "fail_all":
        assert pair.decode_events.errors() == []
    if end.startswith("abort"):
        assert not pair.finished("x")
    pair.check_no_leaks()


def test_a_reservation_whose_uncached_rest_is_short_is_prefilled_at_once_with_no_second_command(role_pair):
    """``Reserve.local_prefill_max_tokens``: the worker applies the router's rule where the cache is, answers
    ``prefill_local`` and starts computing in the same turn; a longer rest is an ordinary reservation that waits for
    its KV. Token-exact either way."""
    pair = role_pair()
    history, user, other = random_prompts(3, 35, 35, seed=68)
    params = greedy(10)
    pair.handoff("t1", history, params)
    pair.settle()
    warm = _next_turn(pair, "t1", history, user[:6], params)  # 35 + 9 + 6 tokens, 32 of them cached here
    reserved = pair.reserve("warm", warm, params, local_max=24)
    assert reserved.ok and reserved.prefill_local and reserved.cached_tokens == 32
    assert pair.decode.engine.requests["warm"].status != RequestStatus.WAITING_FOR_REMOTE_KV  # running already
    long_rest = pair.reserve("cold", other, params, local_max=24)  # 35 uncached tokens: more than 24
    assert long_rest.ok and not long_rest.prefill_local
    pair.run_until(lambda: pair.finished("warm"), what="warm finished")
    assert pair.client_view("warm") == pair.expected(warm, params)
    pair.send_prefill("cold", other, params, long_rest)
    first = pair.wait_first_token("cold")
    pair.start("cold", first)
    pair.run_until(lambda: pair.finished("cold"), what="cold finished")
    assert pair.client_view("cold") == pair.expected(other, params)
    assert pair.decode.counters.local_prefills == 1 and pair.decode_events.errors() == []
    pair.settle()
    pair.check_no_leaks()


def test_a_late_answer_undoes_the_local_prefill_it_started_and_a_new_attempt_runs_alone(role_pair):
    """The router gave up waiting for the answer (its ``abort`` of that attempt's wire id comes): the local prefill
    that the reservation started is stopped, its blocks freed; the attempt the router went on with is untouched."""
    pair = role_pair()
    [prompt] = random_prompts(1, 20, 20, seed=69)
    params = greedy(30)
    assert pair.reserve("x", prompt, params, local_max=32).prefill_local
    pair.tick()
    assert pair.reserve("x.1", prompt, params, local_max=32).prefill_local  # asked again: a request of its own
    pair.decode.abort("x")  # what the runtime does with the router's Abort
    assert "x" not in pair.decode.engine.requests and not pair.finished("x")
    pair.run_until(lambda: pair.finished("x.1"), what="x.1 finished")
    items = pair.decode_events.items("x.1")
    ids, reason = [t for item in items for t in item.token_ids], items[-1].finish_reason.value
    assert (ids, reason) == pair.expected(prompt, params)[::2]  # one request's tokens, from its first on
    assert pair.decode_events.errors() == []
    pair.settle()
    pair.check_no_leaks()


# ---- logprobs and the prefix-cache hit (issue 14: need the engine's logprobs) -------------------------------------


def test_a_local_prefill_sends_the_prompts_logprobs_and_cache_hit_with_its_own_first_token(role_pair):
    pair = role_pair()
    [prompt] = random_prompts(1, 40, 40, seed=67)
    # the second finds the first's full blocks in this engine's prefix cache (it asks for no prompt logprobs, which
    # an engine may compute only for the tokens it computes)
    cases = (("cold", 0, greedy(6, logprobs=2, prompt_logprobs=1)), ("warm", 32, greedy(6, logprobs=2)))
    for rid, cached, params in cases:
        reserved = pair.local(rid, prompt, params)
        assert reserved.cached_tokens == cached
        expected = pair.expected_outputs(prompt, params)
        first, *rest = pair.decode_events.items(rid)
        assert len(first.token_ids) == 1 and first.cached_tokens == cached
        if params.prompt_logprobs is None:
            assert first.prompt_logprobs is None
        else:
            assert_same_logprobs(first.prompt_logprobs, expected[0].prompt_logprobs)
        assert all(item.prompt_logprobs is None and item.cached_tokens is None for item in rest)
        assert_same_logprobs(pair.client_logprobs(rid), [lp for output in expected for lp in output.logprobs or []])
    pair.settle()
    pair.check_no_leaks()


def test_a_recompute_after_a_failed_transfer_sends_no_prompt_figures_again(role_pair):
    """The prefill role's first token already brought the prompt's logprobs; the decode role's recompute of the
    prompt adds none, and its tokens' logprobs continue the first token's."""
    pair = role_pair(failure_policy="recompute")
    [prompt] = random_prompts(1, 45, 45, seed=68)
    params = greedy(8, logprobs=1, prompt_logprobs=0)
    _drop_layer(pair, layer=0)
    pair.send_prefill("x", prompt, params, pair.reserve("x", prompt, params))
    first = pair.wait_first_token("x")
    assert first.prompt_logprobs is not None and first.cached_tokens == 0
    pair.start("x", first)
    pair.run_until(lambda: pair.finished("x"))
    assert pair.decode.totals().recomputes == 1
    expected = pair.expected_outputs(prompt, params)
    assert all(item.prompt_logprobs is None and item.cached_tokens is None for item in pair.decode_events.items("x"))
    assert_same_logprobs(pair.client_logprobs("x"), [lp for output in expected for lp in output.logprobs or []])
    pair.settle()
    pair.check_no_leaks()


# ---- the KV cache in shared memory -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "backend, direct_write, shared",
    [("auto", True, True), ("shm", True, True), ("zmq", True, False), ("auto", False, False)],
)
def test_the_cache_moves_into_shared_memory_for_same_node_direct_writes(tiny_llama_path, backend, direct_write, shared):
    """shm and auto on a CPU (and only when allowed): the engine's cache lives in the receiver's segment, contents kept,
    and the same engine still generates what it generated before."""
    engine = build_engine(tiny_llama_path, kv_blocks=32)
    prompt = random_prompts(1, 20, 20, seed=3)[0]
    before = engine.generate([prompt], greedy(6))[0].token_ids
    engine.kv_cache.kv[0][0, 1].fill_(2.5)  # contents must survive the move
    spec = WorkerSpec(
        "decode-0",
        "decode",
        engine.config,
        RuntimeOptions(["tcp://127.0.0.1:1"], host="127.0.0.1"),
        TransferConfig(direct_write=direct_write),
        transfer_backend=backend,
    )
    segment = shared_kv_cache(spec, engine.kv_cache, ModelFingerprint.from_spec(engine.kv_spec))
    try:
        assert (segment is not None) is shared
        if segment is None:
            return
        assert all(cache.data_ptr() == layer.data_ptr() for cache, layer in zip(engine.kv_cache.kv, segment.layers))
        assert engine.kv_cache.k[0].data_ptr() == segment.layers[0][0].data_ptr()
        assert bool((engine.kv_cache.kv[0][0, 1] == 2.5).all())
        assert engine.generate([prompt], greedy(6))[0].token_ids == before
    finally:
        if segment is not None:
            segment.close()
