"""An authenticated control plane with no configuration: the launcher makes a cluster secret and gives it to every
worker; a command or an event that is not sealed with it (no MAC, a wrong key, a replay, several frames) is dropped
before it is unpacked and counted (the worker's ``control_rejected``, the router's ``pdserve_control_rejected_total``),
and the request it tried to abort, finish or duplicate completes unharmed; the secret never goes on the wire."""

from __future__ import annotations

import json
import time

import httpx
import msgpack
import pytest
import zmq

from engine.request import FinishReason, SamplingParams
from tests.helpers.cluster import metric_value, tiny_cluster_config, wait_until
from transfer.zap import connect_curve, plane_keys
from worker.messages import Abort, Reserve, Stats, TokenItem, Tokens, WorkerCounters, WorkerLoad
from worker.protocol import SEAL_OVERHEAD, Channel, Signer, zmq_endpoint

pytestmark = pytest.mark.timeout(240)
PROMPT, MAX_TOKENS = "the quick brown fox", 40


@pytest.fixture
def sent(monkeypatch):
    """Every frame any ZeroMQ socket of this process sends (the router's asyncio sockets send through a shadow
    zmq.Socket too): (the socket's last endpoint, bytes)."""
    frames: list[tuple[str, bytes]] = []
    original = zmq.Socket.send

    def spy(self, data, flags=0, copy=True, track=False, **kw):
        raw = data.bytes if isinstance(data, zmq.Frame) else bytes(data)
        result = original(self, data, flags, copy=copy, track=track, **kw)  # zmq.Again: not sent, not recorded
        frames.append((self.getsockopt_string(zmq.LAST_ENDPOINT), raw))
        return result

    monkeypatch.setattr(zmq.Socket, "send", spy)
    return frames


@pytest.fixture
def serve(serve):
    """The cluster fixture, with a 30 s request timeout unless a test says otherwise."""

    def start(**sections):
        sections.setdefault("router", {"port": 0, "request_timeout_s": 30})
        return serve(**sections)

    return start


@pytest.fixture
def pusher():
    """PUSH sockets on the same host, connected to any address: a stranger's (no keys: ZeroMQ's handshake drops it,
    transfer/zap.py), or, with the cluster secret, those of a process that holds the cluster's keys, so that what
    is tested is the MAC check behind the handshake."""
    ctx = zmq.Context()

    def connect(address: str, secret: str | None = None) -> zmq.Socket:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)
        if secret is not None:
            connect_curve(sock, plane_keys(secret))
        sock.connect(zmq_endpoint(address))
        return sock

    yield connect
    ctx.destroy(linger=1000)


def _worker(handle, role: str):
    return next(r for r in handle.workers if r.role == role)


def _reference(handle) -> str:
    body = {
        "model": handle.config.served_model_name,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    response = httpx.post(f"{handle.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200
    return response.json()["choices"][0]["text"]


def _stream(handle, after_first_token) -> tuple[str, str | None]:
    """A greedy streamed completion; `after_first_token(wire_rid)` runs once, while the request is live."""
    body = {
        "model": handle.config.served_model_name,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    text, finish, fired = [], None, False
    with httpx.stream("POST", f"{handle.base_url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            choice = chunk["choices"][0]
            text.append(choice["text"])
            finish = choice.get("finish_reason") or finish
            if not fired:
                fired = True
                (wire_rid,) = list(handle.router.flows)
                after_first_token(wire_rid)
    return "".join(text), finish


def _worker_rejected(handle, name: str, want: int, key: str = "control_rejected", at_least: bool = False) -> None:
    """The worker's counter reaches `want` (or more, ``at_least``) in /status and in /metrics (heartbeats lag a
    little)."""
    for _ in range(50):
        status = httpx.get(f"{handle.base_url}/status", timeout=5).json()
        seen = next(w for w in status["workers"] if w["name"] == name).get(key)
        total = metric_value(handle.base_url, "pdserve_worker_total", worker=name, key=key)
        if at_least and seen is not None and total is not None and min(seen, total) >= want:
            return
        if seen == want and total == want:
            return
        time.sleep(0.1)
    raise AssertionError(f"{name}: {key} {seen} in /status, {total} in /metrics; want {want}")


def test_zero_configuration_makes_a_secret_and_every_worker_gets_it(serve, tiny_llama_path):
    handle = serve()
    secret = handle.config.transfer.secret
    assert isinstance(secret, str) and len(bytes.fromhex(secret)) == 32
    assert tiny_cluster_config(tiny_llama_path).transfer.secret is None  # made at start-up, not configured
    for record in handle.workers:
        worker = record.actor.worker
        assert worker.options.secret == secret
    prefill, decode = (_worker(handle, name).actor.worker.role for name in ("prefill", "decode"))
    # every KV endpoint of each worker's rank (worker/rank_kv.py): the prefill's sender, the decode's receiver and sender
    for endpoints in (prefill.sender.kv.endpoints(), decode.receiver.kv.endpoints()):
        assert endpoints and all(end.cfg.secret == secret for end in endpoints)
    assert _reference(handle)  # and it serves


def test_every_control_socket_is_bounded_by_its_largest_real_message(serve, tiny_llama_path):
    """Not the 64 MiB ceiling: the router's event socket takes the largest event its pools' workers can send, each
    worker's command socket the largest command for its context, and their queues what can be in flight."""
    from cluster.routing.router import EVENT_QUEUE_PER_WORKER
    from worker.messages import MAX_MESSAGE_BYTES, command_queue_bound, max_command_bytes
    from worker.protocol import frame_bound

    handle = serve()
    config = handle.config
    max_model_len = (
        config.model.max_model_len
        or json.loads((tiny_llama_path / "config.json").read_text())["max_position_embeddings"]
    )
    events = handle.router._events
    assert events.getsockopt(zmq.MAXMSGSIZE) == frame_bound(config.max_event_bytes(str(tiny_llama_path), max_model_len))
    assert events.getsockopt(zmq.MAXMSGSIZE) < MAX_MESSAGE_BYTES // 4
    assert events.getsockopt(zmq.RCVHWM) == EVENT_QUEUE_PER_WORKER
    for record in handle.workers:
        worker = record.actor.worker
        commands = worker._commands
        assert commands.getsockopt(zmq.MAXMSGSIZE) == frame_bound(
            max_command_bytes(worker.engine.max_model_len, config.router.max_body_bytes)
        )
        assert commands.getsockopt(zmq.RCVHWM) == command_queue_bound(
            worker.spec.engine.max_num_seqs, config.router.queue_size
        )
    assert _reference(handle)  # and it serves


def test_forged_commands_are_dropped_counted_and_harm_no_request(serve, sent, pusher):
    handle = serve()
    expected = _reference(handle)
    decode, prefill = (_worker(handle, role).info["command_address"] for role in ("decode", "prefill"))
    secret = handle.config.transfer.secret
    replay = next(
        raw
        for endpoint, raw in sent
        if endpoint == zmq_endpoint(decode) and msgpack.unpackb(raw[SEAL_OVERHEAD:])["type"] == "reserve"
    )  # the first request's, sealed
    forged: list[bytes] = []

    def forge(wire_rid: str) -> None:
        raw_abort = {"type": "abort", "rid": wire_rid}
        abort = Abort(wire_rid)
        forged.extend(
            [
                msgpack.packb(raw_abort),  # no MAC at all
                msgpack.packb({**raw_abort, "auth": "guess"}),
                Signer("not-the-secret", Channel.COMMANDS, decode).seal(abort),
                Signer(secret, Channel.COMMANDS, prefill).seal(abort),  # the right secret, sealed for another worker
                Signer(secret, Channel.EVENTS, decode).seal(abort),  # ... or for the other direction
                b"short",
                Signer("not-the-secret", Channel.COMMANDS, decode).seal(Reserve("forged", [1, 2, 3], SamplingParams())),
                replay,  # a real command of the first request, replayed
            ]
        )
        stranger = pusher(decode)  # no keys: dropped in the handshake, before a byte of it is buffered
        for frame in forged:
            stranger.send(frame, zmq.NOBLOCK)
        sock = pusher(decode, secret)  # past the handshake: each frame must still fail its MAC, order or shape
        for frame in forged:
            sock.send(frame)
        sock.send_multipart([Signer("x", Channel.COMMANDS, decode).seal(abort), b"more"])
        sock.send(msgpack.packb(raw_abort), zmq.NOBLOCK)

    text, finish = _stream(handle, forge)
    assert text == expected and finish == "length"  # not aborted, nothing lost
    _worker_rejected(handle, "decode-0", len(forged) + 2)
    _worker_rejected(handle, "decode-0", 1, key="handshake_refused", at_least=True)  # each reconnection counts
    _worker_rejected(handle, "prefill-0", 0)
    assert _reference(handle) == expected


def test_forged_and_replayed_events_are_dropped_and_counted_in_metrics(serve, sent, pusher):
    handle = serve()
    expected = _reference(handle)
    router, secret = handle.router.event_address, handle.config.transfer.secret

    def forge(wire_rid: str) -> None:
        raw_finish = {"type": "tokens", "worker": "decode-0", "items": [[wire_rid, [7, 7], "", "stop", None]]}
        finish = Tokens(worker="decode-0", items=[TokenItem(wire_rid, [7, 7], "", FinishReason.STOP)])
        no_room = Stats(
            worker="decode-0",
            role="decode",
            address="tcp://127.0.0.1:1",
            load=WorkerLoad(free_blocks=0),
            counters=WorkerCounters(),
        )
        first = next(
            raw
            for endpoint, raw in sent
            if endpoint == zmq_endpoint(router)
            and raw[SEAL_OVERHEAD:]
            and msgpack.unpackb(raw[SEAL_OVERHEAD:]).get("rid") == wire_rid
        )  # its real first_token
        pusher(router).send(msgpack.packb(raw_finish), zmq.NOBLOCK)  # a stranger: dropped in the handshake
        sock = pusher(router, secret)  # with the cluster's keys: the MACs must hold
        for frame in (
            msgpack.packb(raw_finish),  # a stranger's attempt to end the request
            Signer("not-the-secret", Channel.EVENTS, router).seal(finish),
            Signer(secret, Channel.COMMANDS, router).seal(finish),
            Signer("not-the-secret", Channel.EVENTS, router).seal(no_room),
            b"x" * 10,
            first,
        ):  # replayed: the client would see its first token twice
            sock.send(frame)
        sock.send_multipart([b"tokens", msgpack.packb(raw_finish)])

    text, finish = _stream(handle, forge)
    assert text == expected and finish == "length"
    counts = {
        reason: metric_value(handle.base_url, "pdserve_control_rejected_total", reason=reason)
        for reason in ("bad_mac", "missing_mac", "replayed", "multipart", "malformed", "handshake")
    }
    counts.pop("handshake")
    assert counts == {"bad_mac": 4, "missing_mac": 1, "replayed": 1, "multipart": 1, "malformed": 0}, counts
    wait_until(  # the stranger, at each of its reconnections
        lambda: (metric_value(handle.base_url, "pdserve_control_rejected_total", reason="handshake") or 0) >= 1,
        timeout_s=5,
    )
    assert _reference(handle) == expected


def test_the_secret_never_goes_on_the_wire(serve, sent):
    secret = "configured-secret-for-this-test-0123456789"
    handle = serve(
        transfer={"secret": secret, "deadline_s": 20, "lease_s": 20}, router={"port": 0, "request_timeout_s": 30}
    )
    assert handle.config.transfer.secret == secret
    _reference(handle)
    _stream(handle, lambda rid: None)
    wanted = {"reserve", "prefill", "start", "ping", "reserved", "tokens", "stats"}
    kinds: set = set()
    deadline = time.monotonic() + 5  # the router pings once a second: the requests may all finish before one
    while not wanted <= kinds and time.monotonic() < deadline:
        time.sleep(0.1)
        for _, raw in list(sent):
            try:
                kinds.add(msgpack.unpackb(raw[SEAL_OVERHEAD:])["type"])
            except Exception:  # KV frames: headers sealed differently, payload bytes
                pass
    for _, raw in list(sent):
        assert secret.encode() not in raw
    assert wanted <= kinds
    assert b"".join(raw for _, raw in sent).count(b"hello") >= 1  # the KV handshake was captured too
