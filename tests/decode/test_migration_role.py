"""Migration at the role level: the router's part played by hand with typed commands, between the pair's decode role
(the source) and a second decode role on the same transfer hub (the target).

MigrateIn -> Reserved; MigrateSend(precopy) -> the full blocks move while the source streams on -> Migrated;
Freeze -> Frozen (the tokens so far); MigrateTail -> Reserved; MigrateSend -> the rest moves -> Migrated; the target
streams the rest. What the client would see (the source's items, then the target's) equals one engine's run; a
pre-copy that fails sends everything with the tail; a tail that fails is recomputed on the target; a call-off resumes
on the source; nothing leaks on any side.
"""

from __future__ import annotations

import time
import uuid

import pytest

from decode.worker import DecodeRole, kv_sink
from tests.helpers.engine import random_prompts
from tests.helpers.roles import EventLog, build_engine, copy_params, greedy
from transfer.local_backend import LocalReceiver
from transfer.wire import ModelFingerprint
from worker.messages import Freeze, Frozen, Migrated, MigrateIn, MigrateSend, MigrateTail, Reserved, Resume


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


def _client_view(pair, target_events) -> tuple[list[int], str, str]:
    items = pair.prefill_events.items("x") + pair.decode_events.items("x") + target_events.items("x.1")
    assert items[-1].finish_reason is not None and all(i.finish_reason is None for i in items[:-1])
    return [t for i in items for t in i.token_ids], "".join(i.text for i in items), items[-1].finish_reason.value


def _move_in(pair, target, target_events, prompt, params, precopy_blocks: int) -> Reserved:
    """The target reserves the decoding request "x" under "x.1" for its context so far (what the router asks)."""
    computed = len(prompt) + len(_tokens_so_far(pair)) - 1
    move_in = MigrateIn(
        rid="x.1",
        prompt=list(prompt),
        params=copy_params(params),
        num_computed_tokens=computed,
        precopy_blocks=precopy_blocks,
    )
    target.handle(move_in, time.monotonic())
    [reserved] = target_events.of(Reserved, "x.1")
    return reserved


def _tokens_so_far(pair) -> list[int]:
    return [t for i in pair.prefill_events.items("x") + pair.decode_events.items("x") for t in i.token_ids]


@pytest.mark.parametrize("transfer", ["ok", "precopy failed", "tail failed"])
def test_a_moved_request_streams_exactly_what_one_engine_gives(trio, transfer):
    pair, target, target_events = trio
    [prompt] = random_prompts(1, 30, 30, seed=71)
    params = greedy(30)
    _start_decoding(pair, prompt, params, tokens_first=6)
    computed = len(prompt) + len(_tokens_so_far(pair)) - 1
    precopy = (computed - 1) // target.engine.config.block_size
    reserved = _move_in(pair, target, target_events, prompt, params, precopy)
    now = time.monotonic()
    assert reserved.ok and precopy >= 1
    address = reserved.kv_address if transfer != "precopy failed" else "local://nobody-listens-here"
    dst = reserved.blocks[:precopy]
    pair.decode.handle(MigrateSend(rid="x", target_rid="x.1", kv_address=address, dst_blocks=dst, precopy=True), now)
    _run_until(pair, target, lambda: pair.decode_events.of(Migrated, "x"), "pre-copied")
    [precopied] = pair.decode_events.of(Migrated, "x")
    assert precopied.precopy and precopied.ok == (transfer != "precopy failed")
    assert len(_tokens_so_far(pair)) > 6  # it streamed on from the source meanwhile
    pair.decode.handle(Freeze(rid="x"), time.monotonic())
    [frozen] = pair.decode_events.of(Frozen, "x")
    assert frozen.ok and frozen.output_token_ids == _tokens_so_far(pair)
    pair.tick(3)  # frozen: nothing more comes from the source
    assert len(pair.decode_events.of(Frozen)) == 1 and _tokens_so_far(pair) == frozen.output_token_ids
    first_block = precopy if precopied.ok else 0
    tail = MigrateTail(
        rid="x.1",
        output_token_ids=frozen.output_token_ids,
        num_computed_tokens=frozen.num_computed_tokens,
        first_block=first_block,
    )
    target.handle(tail, time.monotonic())
    [_, adopted] = target_events.of(Reserved, "x.1")
    assert adopted.ok and adopted.blocks[0] == reserved.blocks[first_block]
    address = adopted.kv_address if transfer != "tail failed" else "local://nobody-listens-here"
    send = MigrateSend(
        rid="x", target_rid="x.1", kv_address=address, dst_blocks=adopted.blocks, first_block=first_block
    )
    pair.decode.handle(send, time.monotonic())
    if transfer == "tail failed":  # the router tells the target the source gave up; it recomputes from the tokens
        _run_until(pair, target, lambda: len(pair.decode_events.of(Migrated, "x")) == 2, "migrated")
        target.handle(Resume(rid="x.1"), time.monotonic())
        pair.decode.abort("x")
    _run_until(pair, target, lambda: any(i.finish_reason for i in target_events.items("x.1")), "finished")
    [_, migrated] = pair.decode_events.of(Migrated, "x")
    ok = transfer != "tail failed"
    assert not migrated.precopy and migrated.ok == ok and (migrated.nbytes > 0) == ok
    assert _client_view(pair, target_events) == pair.expected(prompt, params)
    assert target.engine.num_recomputes == (transfer == "tail failed")
    assert pair.decode.totals().migrations_out == ok and target.totals().migrations_in == 1
    _run_until(pair, target, lambda: pair.idle and not target.engine.requests, "idle")
    pair.check_no_leaks()
    target.engine.check_no_leaks()


def test_a_precopy_whose_request_ends_meanwhile_fails_and_nothing_stays_held(trio):
    pair, target, target_events = trio
    [prompt] = random_prompts(1, 40, 40, seed=73)
    params = greedy(12)
    _start_decoding(pair, prompt, params, tokens_first=4)
    reserved = _move_in(pair, target, target_events, prompt, params, precopy_blocks=2)
    dst = reserved.blocks[:2]
    send = MigrateSend(rid="x", target_rid="x.1", kv_address=reserved.kv_address, dst_blocks=dst, precopy=True)
    pair.decode.handle(send, time.monotonic())
    pair.decode.tick()  # its first layer goes out
    pair.decode.abort("x")  # the client left: its blocks are free, no later layer is read from them
    _run_until(pair, target, lambda: pair.decode_events.of(Migrated, "x"), "pre-copy ended")
    [migrated] = pair.decode_events.of(Migrated, "x")
    assert migrated.precopy and not migrated.ok
    target.abort("x.1")  # what the router says once the request ended
    _run_until(pair, target, lambda: pair.idle and not target.engine.requests, "idle")
    pair.check_no_leaks()
    target.engine.check_no_leaks()


def test_a_called_off_move_resumes_on_the_source(trio):
    pair, target, target_events = trio
    [prompt] = random_prompts(1, 30, 30, seed=72)
    params = greedy(24)
    _start_decoding(pair, prompt, params, tokens_first=4)
    pair.decode.handle(Freeze(rid="x"), time.monotonic())
    pair.decode.handle(Resume(rid="x"), time.monotonic())
    pair.run_until(lambda: pair.finished("x"), what="finished on the source")
    assert pair.client_view("x") == pair.expected(prompt, params)
    pair.settle()
    pair.check_no_leaks()


def test_freezing_a_request_that_is_not_decoding_is_refused(trio):
    pair, _, _ = trio
    pair.decode.handle(Freeze(rid="nobody"), time.monotonic())
    [frozen] = pair.decode_events.of(Frozen, "nobody")
    assert not frozen.ok and "unknown request" in frozen.reason
