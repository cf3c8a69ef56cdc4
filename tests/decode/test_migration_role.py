"""Migration at the role level: the router's part played by hand with typed commands, between the pair's decode role
(the source) and a second decode role on the same transfer hub (the target).

A move is the KV hand-off with a decoding source: Reserve(context_tokens) -> Reserved; Export -> the full blocks move
while the source streams on, then the source stops the request (Frozen: its tokens) and the rest moves; Start(the
tokens) -> the target joins on "KV in + tokens in" and streams the rest; Abort releases the source. What the client
would see (the source's items, then the target's) equals one engine's run; a pre-copy that fails leaves the request
running on the source (and a second move without one goes); a tail that fails is computed on the target; a call-off
resumes on the source; nothing leaks on any side.
"""

from __future__ import annotations

import time
import uuid

import pytest

from decode import worker as decode_worker
from decode.worker import DecodeRole, kv_sink
from tests.helpers.engine import random_prompts
from tests.helpers.roles import EventLog, build_engine, copy_params, greedy
from transfer.local_backend import LocalReceiver
from transfer.wire import ModelFingerprint
from worker.messages import ErrorCode, ErrorEvent, Export, Frozen, Reserve, Reserved, Resume, Start


@pytest.fixture
def trio(role_pair):
    """The pair (prefill, source decode) and a target decode role on the pair's hub."""
    pair = role_pair(headroom_tokens=8)
    engine = build_engine(pair.model)
    receiver = LocalReceiver(
        ModelFingerprint.from_spec(engine.kv_spec),
        kv_sink(engine),
        f"local://decode-1-{uuid.uuid4().hex[:8]}",
        hub=pair.hub,
    )
    events = EventLog()
    target = DecodeRole("decode-1", engine, receiver, events, headroom_tokens=8)
    yield pair, target, events
    target.close()


def _run_until(pair, target, condition, what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, what
        pair.tick()
        target.tick()


def _start_decoding(pair, prompt, params, tokens_first: int) -> None:
    reserved = pair.reserve("x", prompt, params)
    pair.send_prefill("x", prompt, params, reserved)
    pair.start("x", pair.wait_first_token("x"))
    items = lambda: sum(len(i.token_ids) for i in pair.decode_events.items("x"))  # noqa: E731
    pair.run_until(lambda: items() >= tokens_first, what="decoding")


def _client_view(pair, target_events, target_rid: str) -> tuple[list[int], str, str]:
    items = pair.prefill_events.items("x") + pair.decode_events.items("x") + target_events.items(target_rid)
    assert items[-1].finish_reason is not None and all(i.finish_reason is None for i in items[:-1])
    return [t for i in items for t in i.token_ids], "".join(i.text for i in items), items[-1].finish_reason.value


def _tokens_so_far(pair) -> list[int]:
    return [t for i in pair.prefill_events.items("x") + pair.decode_events.items("x") for t in i.token_ids]


def _reserve_on_target(pair, target, target_events, prompt, params, target_rid: str) -> Reserved:
    """The target reserves the decoding request "x" under ``target_rid`` for its context so far (the router's ask)."""
    computed = len(prompt) + len(_tokens_so_far(pair)) - 1
    reserve = Reserve(rid=target_rid, prompt=list(prompt), params=copy_params(params), context_tokens=computed)
    target.handle(reserve, time.monotonic())
    [reserved] = target_events.of(Reserved, target_rid)
    assert reserved.ok and len(reserved.blocks) * target.engine.config.block_size > computed
    return reserved


def _export(pair, reserved: Reserved, target_rid: str, address: str | None = None, precopy: bool = True) -> None:
    export = Export(
        rid="x",
        target_rid=target_rid,
        kv_address=address or reserved.kv_address,
        dst_blocks=reserved.blocks,
        precopy=precopy,
    )
    pair.decode.handle(export, time.monotonic())


def _hand_off(pair, target, target_rid: str, lose_kv: bool = False) -> Frozen:
    """What the router does once the source stopped the request: its tokens go to the target (``lose_kv``: the
    target's receiver drops the transfer before it takes the pieces sent with the stop)."""
    deadline = time.monotonic() + 30
    while not pair.decode_events.of(Frozen, "x"):  # the target does not poll meanwhile
        assert time.monotonic() < deadline, "stopped"
        pair.tick()
    [frozen] = pair.decode_events.of(Frozen, "x")
    assert frozen.output_token_ids == _tokens_so_far(pair)
    if lose_kv:
        target.receiver.abort(target_rid, "lost on the way")
    target.handle(Start(rid=target_rid, tokens=frozen.output_token_ids), time.monotonic())
    return frozen


@pytest.mark.parametrize("transfer", ["ok", "precopy failed", "tail failed"])
def test_a_moved_request_streams_exactly_what_one_engine_gives(trio, transfer):
    pair, target, target_events = trio
    [prompt] = random_prompts(1, 30, 30, seed=71)
    params = greedy(30)
    _start_decoding(pair, prompt, params, tokens_first=6)
    target_rid = "x.1"
    reserved = _reserve_on_target(pair, target, target_events, prompt, params, target_rid)
    if transfer == "precopy failed":  # nobody listens there: the export fails before the request stops
        _export(pair, reserved, target_rid, address="local://nobody-listens-here")
        _run_until(pair, target, lambda: pair.decode_events.of(ErrorEvent, target_rid), "export failed")
        [error] = pair.decode_events.of(ErrorEvent, target_rid)
        assert error.code is ErrorCode.KV_TRANSFER_FAILED and not pair.decode_events.of(Frozen)
        before = len(_tokens_so_far(pair))
        pair.tick(2)
        assert len(_tokens_so_far(pair)) > before  # it streams on from the source
        target.abort(target_rid)  # the router calls that move off, then moves it again without a pre-copy
        target_rid = "x.2"
        reserved = _reserve_on_target(pair, target, target_events, prompt, params, target_rid)
        _export(pair, reserved, target_rid, precopy=False)
    elif transfer == "tail failed":  # no pre-copy: it stops at once; its KV is lost on the way (below)
        _export(pair, reserved, target_rid, precopy=False)
    else:
        _export(pair, reserved, target_rid)
        pair.tick(2)
        assert len(_tokens_so_far(pair)) > 6  # it streamed on from the source during the pre-copy
    frozen = _hand_off(pair, target, target_rid, lose_kv=transfer == "tail failed")
    pair.tick(3)  # stopped: nothing more comes from the source
    assert len(pair.decode_events.of(Frozen)) == 1 and _tokens_so_far(pair) == frozen.output_token_ids
    if transfer == "tail failed":  # the source says so; the router tells the target its KV will not come
        _run_until(pair, target, lambda: pair.decode_events.of(ErrorEvent, target_rid), "the source's news")
        target.handle(Resume(rid=target_rid), time.monotonic())  # it computes it from the tokens (done already)
    _run_until(pair, target, lambda: any(i.finish_reason for i in target_events.items(target_rid)), "finished")
    pair.decode.abort("x")  # the router, once the target streams: the source lets go
    assert _client_view(pair, target_events, target_rid) == pair.expected(prompt, params)
    assert target.engine.num_recomputes == (transfer == "tail failed")
    _run_until(pair, target, lambda: pair.idle and not target.engine.requests and not pair.decode.has_work(), "idle")
    assert target.totals().migrations_in == (transfer != "tail failed")
    assert pair.decode.totals().migrations_out == (transfer != "tail failed")
    assert (pair.decode.totals().migration_bytes > 0) == (transfer != "tail failed")
    pair.check_no_leaks()
    target.engine.check_no_leaks()


def test_a_precopy_whose_request_ends_meanwhile_fails_and_nothing_stays_held(trio):
    pair, target, target_events = trio
    [prompt] = random_prompts(1, 40, 40, seed=73)
    params = greedy(12)
    _start_decoding(pair, prompt, params, tokens_first=4)
    reserved = _reserve_on_target(pair, target, target_events, prompt, params, "x.1")
    _export(pair, reserved, "x.1")
    pair.decode.tick()  # its first layers go out
    assert not pair.decode_events.of(Frozen)
    pair.decode.abort("x")  # the client left: its blocks are free, no later layer is read from them
    target.abort("x.1")  # what the router tells both ends
    _run_until(pair, target, lambda: not pair.decode.has_work() and not target.engine.requests, "ended")
    assert not pair.decode_events.of(ErrorEvent)  # the router knows: the failed transfer is no news
    _run_until(pair, target, lambda: pair.idle, "idle")
    pair.check_no_leaks()
    target.engine.check_no_leaks()


@pytest.mark.parametrize("when", ["exporting", "stopped"])
def test_a_called_off_move_resumes_on_the_source(trio, when):
    pair, target, target_events = trio
    [prompt] = random_prompts(1, 30, 30, seed=72)
    params = greedy(24)
    _start_decoding(pair, prompt, params, tokens_first=4)
    reserved = _reserve_on_target(pair, target, target_events, prompt, params, "x.1")
    _export(pair, reserved, "x.1", precopy=when == "exporting")
    if when == "stopped":
        _run_until(pair, target, lambda: pair.decode_events.of(Frozen, "x"), "stopped")
    target.abort("x.1")  # the target went away: the router lets its reservation go and the source run on
    pair.decode.handle(Resume(rid="x"), time.monotonic())
    pair.decode.handle(Resume(rid="x"), time.monotonic())  # twice (a late Frozen answered): no harm
    pair.run_until(lambda: pair.finished("x"), what="finished on the source")
    assert pair.client_view("x") == pair.expected(prompt, params)
    _run_until(pair, target, lambda: pair.idle and not pair.decode.has_work(), "idle")
    pair.check_no_leaks()
    target.engine.check_no_leaks()


def test_exporting_a_request_that_is_not_decoding_is_refused(trio):
    pair, _, _ = trio
    export = Export(rid="nobody", target_rid="nobody.1", kv_address="local://x", dst_blocks=[1])
    with pytest.raises(KeyError, match="unknown request"):  # the runtime answers it with invalid_request
        pair.decode.handle(export, time.monotonic())
    assert not pair.decode.has_work()


def test_a_move_target_aborted_before_its_tokens_frees_its_blocks(trio):
    pair, target, target_events = trio
    [prompt] = random_prompts(1, 30, 30, seed=74)
    params = greedy(16)
    _start_decoding(pair, prompt, params, tokens_first=3)
    _reserve_on_target(pair, target, target_events, prompt, params, "x.1")
    target.abort("x.1")
    assert not target.engine.requests and not target.receiver.pending_transfers()
    pair.run_until(lambda: pair.finished("x"), what="finished on the source")
    pair.settle()
    pair.check_no_leaks()
    target.engine.check_no_leaks()


def test_the_stop_is_said_after_its_tail_went(trio):
    """The source sends a move's last KV before its ``Frozen``: the router's ``Start`` then finds the tail landed or
    landing, and the stops of one turn reach the target together (it would otherwise step with the first of them while
    the rest came, and hold those still for that whole step)."""
    pair, target, target_events = trio
    [prompt] = random_prompts(1, 30, 30, seed=72)
    params = greedy(30)
    _start_decoding(pair, prompt, params, tokens_first=6)
    reserved = _reserve_on_target(pair, target, target_events, prompt, params, "x.1")
    _export(pair, reserved, "x.1", precopy=False)
    order: list[str] = []
    sender = pair.decode._migration_sender()
    finish = sender.finish
    sender.finish = lambda transfer_id: (order.append(f"finish {transfer_id}"), finish(transfer_id))[1]
    emit = pair.decode.emit
    pair.decode.emit = lambda event: (order.append(f"{type(event).__name__} {event.rid}"), emit(event))[1]
    frozen = _hand_off(pair, target, "x.1")
    assert order.index("finish x.1") < order.index("Frozen x") and frozen.output_token_ids == _tokens_so_far(pair)
    _run_until(pair, target, lambda: any(i.finish_reason for i in target_events.items("x.1")), "finished")
    pair.decode.abort("x")
    assert _client_view(pair, target_events, "x.1") == pair.expected(prompt, params)
    _run_until(pair, target, lambda: pair.idle and not target.engine.requests and not pair.decode.has_work(), "idle")
    pair.check_no_leaks()
    target.engine.check_no_leaks()


def test_the_target_waits_a_bounded_while_for_a_moves_other_half(trio):
    """A move whose tokens came but whose KV has not (or the reverse) holds the target's next step up to a share of
    its last step (``MOVE_JOIN_WAIT_SHARE``, at most ``MOVE_JOIN_WAIT_MAX_S``), then its other requests step on
    without it: a bound, never a hang. The times are the role's clock, set by hand."""
    pair, target, target_events = trio
    now = [1000.0]
    target.clock = lambda: now[0]
    target.engine.set_clock(target.clock)
    [local, prompt] = random_prompts(2, 12, 30, seed=73)
    target.engine.add_request(local, greedy(40), request_id="here")
    target.tick()  # its prefill
    target.tick()
    target._last_step_s = 0.1  # the last step took 100 ms (of the hand-set clock)
    steps = lambda: len(target.engine.requests["here"].output_token_ids)  # noqa: E731
    _start_decoding(pair, prompt, greedy(30), tokens_first=4)
    _reserve_on_target(pair, target, target_events, prompt, greedy(30), "x.1")
    target.handle(Start(rid="x.1", tokens=_tokens_so_far(pair)), now[0])  # its tokens; its KV never leaves here
    before = steps()
    target.tick()
    assert steps() == before  # held: the other half is a transfer away
    now[0] += decode_worker.MOVE_JOIN_WAIT_SHARE * 0.1 - 0.001
    target.tick()
    assert steps() == before
    now[0] += 0.002  # past the share of the last step: the others step on without it
    target.tick()
    assert steps() == before + 1
    target.abort("x.1")
    _run_until(pair, target, lambda: "here" not in target.engine.requests, "finished")
    pair.decode.abort("x")
    _run_until(pair, target, lambda: pair.idle and not target.engine.requests and not pair.decode.has_work(), "idle")
    pair.check_no_leaks()
    target.engine.check_no_leaks()
