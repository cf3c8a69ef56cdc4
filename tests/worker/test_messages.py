"""Typed control messages (worker/messages.py): every kind survives the wire as itself; what is not a valid message
(undecodable, an unknown kind, a missing, unknown, wrong-typed or out-of-range field, too large, the other
direction's) is a MalformedMessage, which the sealing layer reports as Rejection.MALFORMED only after the MAC was
checked; a worker given such a command counts it in control_rejected and keeps serving; the router's /metrics keys,
/status fields and per-response timing come from the Structs' fields."""

from __future__ import annotations

import time

import msgpack
import msgspec
import pytest
import zmq

from cluster.routing.membership import heartbeat_status
from cluster.routing.metrics import GAUGE_KEYS, TOTAL_KEYS, RouterMetrics
from engine.config import EngineConfig
from engine.request import FinishReason, SamplingParams, TokenLogprob
from tests.helpers.engine import random_prompts
from transfer import auth, errors
from transfer.zap import connect_curve, plane_keys, serve_curve
from worker.messages import (
    MAX_MESSAGE_BYTES,
    Abort,
    ErrorCode,
    ErrorEvent,
    Frozen,
    Generate,
    MalformedMessage,
    Ping,
    Prefill,
    ProtocolError,
    Reserve,
    Reserved,
    Start,
    Stats,
    Timing,
    TokenItem,
    Tokens,
    WorkerCounters,
    WorkerLoad,
    command_queue_bound,
    decode_command,
    decode_event,
    encode,
    kind,
    max_command_bytes,
    max_event_bytes,
)
from worker.protocol import (
    AuthError,
    Channel,
    Rejection,
    Signer,
    Verifier,
    control_key,
    frame_bound,
    with_start_value,
    zmq_endpoint,
)

SECRET = "typed-messages-test-secret-0123456789"
PARAMS = SamplingParams(
    max_tokens=7, temperature=0.5, top_p=0.9, top_k=3, seed=11, stop=["x"], stop_token_ids=[2], ignore_eos=True
)


def _stats(**load: int) -> Stats:
    counters = WorkerCounters(**{name: index + 1 for index, name in enumerate(WorkerCounters.__struct_fields__)})
    counters.transfer_seconds = 2.5
    return Stats(
        worker="decode-0",
        role="decode",
        address="tcp://127.0.0.1:5555",
        load=WorkerLoad(**load),
        counters=counters,
        degraded="",
        loop_age_s=0.125,
        kv_paths={"shm+tcp://10.0.0.2:7000": "inline", "shm+tcp://127.0.0.1:7001": "shm-ring"},
    )


COMMANDS = [
    Reserve("r1", [1, 2, 3], PARAMS, local_prefill_max_tokens=64, router=1, sent_at=1234.5),
    Prefill("r1", [1, 2, 3], PARAMS, "tcp://127.0.0.1:9", [7, 8]),
    Start("r1", [42], router=2),
    Generate("r2", [5], SamplingParams()),
    Abort("r2"),
    Ping(router=3),
]
EVENTS = [
    Reserved(rid="r1", worker="decode-0", ok=True, blocks=[7, 8], kv_address="tcp://127.0.0.1:9"),
    Reserved(rid="r1", worker="decode-0", ok=False, reason="kv_full"),
    Tokens(
        worker="decode-0",
        items=[
            TokenItem("r1", [1, 2], "ab"),
            TokenItem("r2", [], "", FinishReason.STOP, Timing(kv_done_mono=1.0, decode_queue_s=0.01)),
            TokenItem("r3", [9], "z", FinishReason.LENGTH, Timing(prefill_queue_s=0.5)),
            TokenItem(
                "r4",
                [5],
                "q",
                None,
                None,
                [TokenLogprob(5, -0.25, [(5, -0.25), (6, -1.5)])],
                [None, TokenLogprob(3, -2.0)],
                16,
            ),
        ],
    ),
    ErrorEvent(rid="r1", worker="prefill-0", message="boom", code=ErrorCode.KV_TRANSFER_FAILED),
    Tokens(  # a prefill worker's first token
        worker="prefill-0",
        items=[
            TokenItem(
                "r2",
                [7],
                "x",
                None,
                Timing(prefill_queue_s=0.1, prefill_compute_s=0.2, prefill_end_mono=3.0),
                [TokenLogprob(7, -0.5, [(7, -0.5)])],
                [None, TokenLogprob(1, -3.0, [(2, -0.1)])],
                32,
            )
        ],
    ),
    _stats(waiting=1, running=2, requests=3, free_blocks=4, total_blocks=5, awaiting_kv=6, leased_transfers=7),
]


@pytest.mark.parametrize("message", COMMANDS, ids=kind)
def test_every_command_round_trips_as_itself(message):
    assert decode_command(encode(message)) == message
    assert msgpack.unpackb(encode(message))["type"] == kind(message)  # the protocol's names on the wire


@pytest.mark.parametrize("message", EVENTS, ids=kind)
def test_every_event_round_trips_as_itself(message):
    decoded = decode_event(encode(message))
    assert decoded == message and type(decoded) is type(message)


def test_a_tokens_item_is_a_positional_array_on_the_wire():
    """[rid, token ids, text, finish reason, timing, logprobs, prompt logprobs, cached tokens, index]: nil when
    absent."""
    wire = msgpack.unpackb(encode(EVENTS[2]))
    assert wire["items"][0] == ["r1", [1, 2], "ab", None, None, None, None, None, None]
    assert wire["items"][1][3] == "stop" and wire["items"][1][4] == {"kv_done_mono": 1.0, "decode_queue_s": 0.01}
    assert wire["items"][1][5:] == [None, None, None, None]
    first = wire["items"][3]  # a first sampled token: its logprobs, the prompt's, and the prefix-cache hit
    assert first[:5] == ["r4", [5], "q", None, None]
    assert first[5] == [{"token_id": 5, "logprob": -0.25, "top": [[5, -0.25], [6, -1.5]]}]
    assert first[6] == [None, {"token_id": 3, "logprob": -2.0, "top": []}]
    assert first[7] == 16


def _raw(**fields) -> bytes:
    return msgpack.packb(fields)


GOOD_ABORT = {"type": "abort", "rid": "r1", "router": 0}
MALFORMED_COMMANDS = {
    "not msgpack": b"\xc1",
    "truncated": encode(COMMANDS[0])[:-3],
    "not a map": msgpack.packb([1, 2, 3]),
    "no type": _raw(rid="r1"),
    "unknown type": _raw(type="detonate", rid="r1"),
    "an event's type": encode(EVENTS[0]),
    "missing field": _raw(type="start", rid="r1"),
    "unknown field": _raw(**GOOD_ABORT, extra=1),
    "wrong-typed rid": _raw(type="abort", rid=5),
    "wrong-typed prompt": _raw(type="generate", rid="r", prompt=["a"], params={}),
    "wrong-typed params": _raw(type="generate", rid="r", prompt=[1], params={"max_tokens": "many"}),
    "negative router index": _raw(**{**GOOD_ABORT, "router": -1}),
    "integer map keys": msgpack.packb({1: "abort"}),
}


@pytest.mark.parametrize("data", MALFORMED_COMMANDS.values(), ids=MALFORMED_COMMANDS.keys())
def test_what_is_not_a_valid_command_is_a_typed_error(data):
    assert decode_command(_raw(**GOOD_ABORT)) == Abort("r1")  # the baseline the cases break
    with pytest.raises(MalformedMessage) as error:
        decode_command(data)
    assert isinstance(error.value, ProtocolError)


def test_what_is_not_a_valid_event_is_a_typed_error():
    for data in (
        encode(COMMANDS[0]),
        _raw(type="stats", worker="w"),
        _raw(type="tokens", worker="w", items=[["r"]]),
        _raw(type="error", worker="w", rid="r", message="m", code="no_such_code"),
        _raw(type="reserved", worker="w", rid="r", ok=True, reason="because"),
    ):
        with pytest.raises(MalformedMessage):
            decode_event(data)


def test_a_body_over_the_size_bound_is_refused_before_it_is_decoded():
    with pytest.raises(MalformedMessage, match="exceeds"):
        decode_command(b"\x90" * (MAX_MESSAGE_BYTES + 1))


def test_the_largest_real_messages_fit_their_bounds_far_below_the_ceiling():
    """Each socket's bound is what its largest legitimate message needs: a command with a whole context of token ids
    and block ids and a request body's worth of parameters; a step's tokens for a full batch with top logprobs and
    the prompt logprobs of as many positions as the KV holds; a move's frozen tokens."""
    max_model_len, body_bytes, max_num_seqs, kv_tokens, step = 4096, 1 << 20, 64, 11_000, 5
    command_bound = max_command_bytes(max_model_len, body_bytes)
    ids = list(range(2**32 - max_model_len, 2**32))  # the widest msgpack ints a token or block id takes
    bias = {2**32 - 1 - i: -100.125 for i in range(body_bytes // 16)}  # ~16 JSON bytes per entry: a full body
    params = SamplingParams(max_tokens=max_model_len, stop=["x" * 100] * 4, logit_bias=bias, logprobs=20)
    prefill = Prefill("r" * 64, ids, params, kv_address="shm+tcp://127.0.0.1:65535#" + "f" * 16, dst_blocks=ids)
    assert len(encode(prefill)) <= command_bound < MAX_MESSAGE_BYTES // 16
    top = [(2**32 - 1, -1e-300)] * 20
    position = TokenLogprob(2**32 - 1, -1e-300, top)
    items = [
        TokenItem(
            "r" * 64, [2**32 - 1] * step, "\U0001f600" * 8 * step, FinishReason.LENGTH, Timing(), [position] * step
        )
        for _ in range(max_num_seqs)
    ]
    items[0].prompt_logprobs = [None] + [position] * (kv_tokens - 1)  # every position the KV holds
    event_bound = max_event_bytes(max_model_len, max_num_seqs, kv_tokens, step)
    assert len(encode(Tokens(worker="decode-0", items=items))) <= event_bound < MAX_MESSAGE_BYTES // 8
    frozen = Frozen(worker="decode-0", rid="r" * 64, output_token_ids=ids)
    assert len(encode(frozen)) <= event_bound
    assert frame_bound(command_bound) < frame_bound(event_bound) <= frame_bound(MAX_MESSAGE_BYTES * 2)
    assert command_queue_bound(64, 256) < 100_000


def test_sampling_values_are_checked_by_the_worker_not_the_decoder():
    """A well-typed but invalid value decodes (the worker's validate() answers the request with invalid_request)."""
    command = decode_command(encode(Generate("r", [1], SamplingParams(temperature=-1.0))))
    with pytest.raises(ValueError, match="temperature"):
        command.params.validate()


def test_engine_error_codes_map_onto_the_closed_set():
    assert ErrorCode.from_engine("sampling_error") is ErrorCode.SAMPLING_ERROR
    assert ErrorCode.from_engine("something_new") is ErrorCode.WORKER_ERROR
    assert ErrorCode.from_engine(None) is ErrorCode.WORKER_ERROR


def test_the_mac_is_checked_before_the_body_is_decoded():
    address = "tcp://127.0.0.1:1"
    verifier = Verifier(SECRET, Channel.COMMANDS, address)
    garbage = b"\xc1 not a message"
    with pytest.raises(AuthError) as error:  # a stranger's garbage is a bad MAC, not a decode error
        verifier.open(Signer("wrong-secret", Channel.COMMANDS, address).seal_body(garbage))
    assert error.value.reason is Rejection.BAD_MAC
    signer = Signer(SECRET, Channel.COMMANDS, address)
    with pytest.raises(AuthError) as error:  # sealed with the secret: a malformed message, a bug of the sender
        verifier.open(signer.seal_body(garbage))
    assert error.value.reason is Rejection.MALFORMED
    assert verifier.open(signer.seal(COMMANDS[3])) == COMMANDS[3]  # typed, by the channel's decoder
    events = Verifier(SECRET, Channel.EVENTS, address)
    assert events.open(Signer(SECRET, Channel.EVENTS, address).seal(EVENTS[4])) == EVENTS[4]


def test_a_restarted_receiver_refuses_what_was_sealed_for_its_predecessor():
    """Same endpoint (a port reused), same configured secret: the start value in the address changes the key."""
    endpoint = "tcp://127.0.0.1:5555"
    before, after = with_start_value(endpoint), with_start_value(endpoint)
    assert before != after and zmq_endpoint(before) == zmq_endpoint(after) == endpoint
    captured = Signer(SECRET, Channel.COMMANDS, before).seal(COMMANDS[3])
    assert Verifier(SECRET, Channel.COMMANDS, before).open(captured) == COMMANDS[3]
    with pytest.raises(AuthError) as error:
        Verifier(SECRET, Channel.COMMANDS, after).open(captured)
    assert error.value.reason is Rejection.BAD_MAC


def test_both_planes_seal_with_one_primitive():
    address = "tcp://127.0.0.1:1"
    key = control_key(SECRET, Channel.COMMANDS, address)
    frame = Signer(SECRET, Channel.COMMANDS, address).seal(COMMANDS[3])
    assert auth.verify(key, frame) and not auth.verify(control_key(SECRET, Channel.EVENTS, address), frame)
    _, sender, seq, body = auth.split(frame)
    assert len(sender) == auth.IDENT_BYTES and seq == 1 and auth.seal(key, sender, seq, bytes(body)) == frame
    verifier = Verifier(SECRET, Channel.COMMANDS, address)
    assert verifier.open(auth.seal(key, sender, 5, encode(COMMANDS[3]))) == COMMANDS[3]  # the KV plane's seal
    with pytest.raises(errors.AuthError) as error:  # one AuthError for both planes, with the control plane's reason
        verifier.open(frame)  # seq 1 <= 5 from the same sender
    assert error.value.reason is Rejection.REPLAYED and error.value.code == "unauthenticated"
    assert AuthError is errors.AuthError and issubclass(MalformedMessage, errors.ProtocolError)
    assert ProtocolError is errors.ProtocolError


# ---- the router's names come from the Structs ------------------------------------------------------------------


def test_metrics_keys_are_the_heartbeat_structs_fields():
    assert GAUGE_KEYS == WorkerLoad.__struct_fields__ and TOTAL_KEYS == WorkerCounters.__struct_fields__
    stats = EVENTS[-1]
    metrics = RouterMetrics()
    metrics.observe_worker(stats)
    labels = {"worker": stats.worker, "pool": stats.role}
    for key in WorkerLoad.__struct_fields__:
        assert metrics.local_value("pdserve_worker", **labels, key=key) == getattr(stats.load, key)
    for key in WorkerCounters.__struct_fields__:
        assert metrics.local_value("pdserve_worker_total", **labels, key=key) == getattr(stats.counters, key)


def test_status_shows_a_heartbeat_as_one_flat_map():
    stats = EVENTS[-1]
    status = heartbeat_status(stats)
    assert set(status) == (
        {"address", "degraded", "loop_age_s", "epoch", "kv_paths"}
        | set(WorkerLoad.__struct_fields__)
        | set(WorkerCounters.__struct_fields__)
    )
    assert status["kv_paths"] == stats.kv_paths  # how its KV sender reaches each receiver
    assert status["free_blocks"] == 4 and status["control_rejected"] == stats.counters.control_rejected
    assert heartbeat_status(None) == {}


def test_the_response_timing_shows_set_fields_flags_as_one_and_no_monotonic_stamps():
    timing = Timing(prefill_queue_s=0.1, prefill_compute_s=0.2, prefill_end_mono=3.0, decode_cached_tokens=16)
    timing.merge(Timing(kv_done_mono=4.0, kv_transfer_s=0.5, kv_wait_after_first_token_s=0.0, recomputed=True))
    assert timing.response() == {
        "prefill_queue_s": 0.1,
        "prefill_compute_s": 0.2,
        "decode_cached_tokens": 16.0,
        "kv_transfer_s": 0.5,
        "kv_wait_after_first_token_s": 0.0,
        "recomputed": 1.0,
    }
    timing.merge(Timing(prefill_queue_s=None, recomputed=False))  # what a later item leaves out stays
    assert timing.prefill_queue_s == 0.1 and timing.recomputed
    assert Timing().response() == {}


# ---- a worker given malformed commands ---------------------------------------------------------------------------


def test_a_worker_counts_malformed_authenticated_commands_and_keeps_serving(tiny_llama_path):
    from worker.colocated import ColocatedRole
    from worker.runtime import WorkerRuntime
    from worker.spec import RuntimeOptions, WorkerSpec

    ctx = zmq.Context()
    events_sock = ctx.socket(zmq.PULL)
    events_sock.setsockopt(zmq.LINGER, 0)
    serve_curve(events_sock, plane_keys(SECRET))  # the worker connects as a CURVE client (transfer/zap.py)
    router_address = f"tcp://127.0.0.1:{events_sock.bind_to_random_port('tcp://127.0.0.1')}"
    verifier = Verifier(SECRET, Channel.EVENTS, router_address)
    engine = EngineConfig(model=str(tiny_llama_path), kv_blocks=32, torch_threads=1, max_model_len=128)
    spec = WorkerSpec(
        name="colocated-0",
        role="colocated",
        engine=engine,
        runtime=RuntimeOptions(router_addresses=[router_address], secret=SECRET),
    )
    worker = WorkerRuntime(spec, ColocatedRole)
    worker.start()
    commands = ctx.socket(zmq.PUSH)
    commands.setsockopt(zmq.LINGER, 0)
    connect_curve(commands, plane_keys(SECRET))
    commands.connect(zmq_endpoint(worker.command_address))
    signer = Signer(SECRET, Channel.COMMANDS, worker.command_address)
    received: list = []

    def wait_for(condition, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, received[-5:]
            if events_sock.poll(50):
                received.append(verifier.open(events_sock.recv()))

    oversized = ctx.socket(zmq.PUSH)  # a holder of the keys whose frame is over the worker's bound: dropped unread
    oversized.setsockopt(zmq.LINGER, 0)
    connect_curve(oversized, plane_keys(SECRET))
    oversized.connect(zmq_endpoint(worker.command_address))
    bound = max_command_bytes(128, 1 << 20)  # the spec's max_model_len and the router's default body bound
    try:
        assert worker._commands.getsockopt(zmq.MAXMSGSIZE) == frame_bound(bound)
        assert worker._commands.getsockopt(zmq.RCVHWM) == command_queue_bound(engine.max_num_seqs, 256)
        oversized.send(Signer(SECRET, Channel.COMMANDS, worker.command_address).seal_body(b"\x90" * (bound + 1)))
        malformed = [signer.seal_body(data) for data in MALFORMED_COMMANDS.values()]
        malformed.append(signer.seal(Abort("r", router=1)))  # well formed, but this worker knows one router only
        for frame in malformed:
            commands.send(frame)
        prompt = random_prompts(1, 8, 8, seed=5)[0]
        commands.send(
            signer.seal(Generate("ok", prompt, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)))
        )
        commands.send(signer.seal(Generate("bad", prompt, SamplingParams(top_p=0.0))))  # decodes; validate() fails

        def finished() -> bool:
            items = [i for e in received if isinstance(e, Tokens) for i in e.items if i.rid == "ok"]
            return bool(items) and items[-1].finish_reason is FinishReason.LENGTH

        wait_for(finished)
        wait_for(lambda: any(isinstance(e, Stats) and e.counters.control_rejected == len(malformed) for e in received))
        tokens = [t for e in received if isinstance(e, Tokens) for i in e.items if i.rid == "ok" for t in i.token_ids]
        assert len(tokens) == 5
        errors = [e for e in received if isinstance(e, ErrorEvent)]
        assert [(e.rid, e.code) for e in errors] == [("bad", ErrorCode.INVALID_REQUEST)]
        assert "top_p" in errors[0].message
        assert worker.counters.control_rejected == len(malformed) and worker.counters.errors == 1
        wait_for(lambda: not worker.engine.requests)
        worker.engine.check_no_leaks()
        assert msgspec.to_builtins(worker.stats())["counters"]["control_rejected"] == len(malformed)
        assert worker.snapshot()["counters"]["control_rejected"] == len(malformed)  # plain data, for Ray
    finally:
        worker.stop()
        commands.close(0)
        oversized.close(0)
        events_sock.close(0)
        ctx.term()
