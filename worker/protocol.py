"""Control-plane messages between the router and the workers: msgpack maps over ZeroMQ, never pickle.

Router -> worker (each worker's PULL socket):
    reserve  {rid, prompt, params}                      decode: reserve KV blocks, expect the transfer
    prefill  {rid, prompt, params, kv_address, dst_blocks}   prefill: compute, stream KV, sample the first token
    start    {rid, first_token}                         decode: the first token (KV may still be arriving)
    generate {rid, prompt, params}                      colocated: both phases here
    abort    {rid}                                      any: free whatever the request holds
Worker -> router (the router's PULL socket):
    reserved    {rid, worker, ok, blocks, kv_address, reason}
    first_token {rid, worker, token, text, timing}
    tokens      {worker, items: [[rid, [token ids], text, finish_reason | None, timing | None], ...]}  one per step
    error       {rid, worker, message, code}
    stats       {worker, role, ...load and counters}    a heartbeat, several times a second
Workers detokenize (``engine.detokenizer``, in the engine): ``text`` is what the tokens add to the request's output,
ready to send to the client (held-back characters come later; a stop string is already cut, finish_reason "stop").
The decode worker's texts continue the prefill worker's first-token text; the router only relays them.
Sizes are bounded on unpack, map keys must be strings, and only plain types (ints, floats, strings, lists, maps)
can appear, so a message cannot make the receiver run anything.

Every message is sealed (``Signer.seal``) and opened (``Verifier.open``) here and nowhere else. A frame is
``tag(32) | sender(8) | seq(8) | msgpack body`` with ``tag = HMAC-SHA256(key, sender | seq | body)``; the receiver
checks the tag with ``hmac.compare_digest`` before msgpack sees a byte, so a stranger who can reach a socket cannot
make a worker reserve, prefill, generate or abort, nor feed the router tokens, finishes or heartbeats. The key is
derived from the cluster secret, the direction (commands or events) and the address of the receiving socket, so a
message is valid only at the socket it was sent to: a restarted worker or router binds a new random port, and what
was captured before is worthless there. ``sender`` is random per sending socket and ``seq`` strictly increases on it
(one socket delivers in order); the receiver remembers the last ``seq`` of each sender it authenticated, so a replayed
message is refused too. The secret itself never goes on the wire. What is dropped is counted by reason
(``Rejection``): a worker's ``control_rejected`` counter, the router's ``pdserve_control_rejected_total``.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import itertools
import logging
import os
import struct
from collections import OrderedDict
from dataclasses import asdict

import msgpack

from engine.request import SamplingParams

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
TAG_BYTES = 32
PREFIX = struct.Struct(">8sQ")  # sender id, sequence number
SEAL_OVERHEAD = TAG_BYTES + PREFIX.size
MAX_FRAME_BYTES = MAX_MESSAGE_BYTES + SEAL_OVERHEAD  # zmq.MAXMSGSIZE of every control socket
MAX_SENDERS = 4096  # senders whose last sequence number a receiver remembers (least recently heard forgotten first)


class ProtocolError(ValueError):
    pass


class Channel(str, enum.Enum):
    COMMANDS = "commands"  # router -> a worker's command socket
    EVENTS = "events"  # workers -> the router's event socket


class Rejection(str, enum.Enum):
    MISSING_MAC = "missing_mac"  # shorter than a tag and its prefix
    BAD_MAC = "bad_mac"  # not sealed with this cluster's secret for this socket
    REPLAYED = "replayed"  # a sequence number this sender already used
    MULTIPART = "multipart"  # control messages are one frame
    MALFORMED = "malformed"  # authenticated, but not a valid message (a bug of the sender, not an attack)


class AuthError(ProtocolError):
    """A control message dropped before it was unpacked (or, MALFORMED, after it was authenticated)."""

    def __init__(self, reason: Rejection, detail: str = "") -> None:
        super().__init__(f"{reason.value}{': ' + detail if detail else ''}")
        self.reason = reason


def _key(secret: str | None, channel: Channel, address: str) -> bytes:
    if not secret:
        raise ValueError("the control plane needs the cluster secret (transfer.secret; the launcher makes one)")
    label = f"pdserve/v1/control/{channel.value}/{address}".encode()
    return hmac.digest(secret.encode(), label, hashlib.sha256)


class Signer:
    """Seals the messages one sending socket sends to `address` (the receiving socket's address)."""

    def __init__(self, secret: str | None, channel: Channel, address: str) -> None:
        self._key = _key(secret, channel, address)
        self._sender = os.urandom(8)
        self._seq = itertools.count(1)  # next() is atomic under the GIL

    def seal(self, message: dict) -> bytes:
        prefix = PREFIX.pack(self._sender, next(self._seq))
        body = pack(message)
        mac = hmac.new(self._key, prefix, hashlib.sha256)
        mac.update(body)
        return b"".join((mac.digest(), prefix, body))


class Verifier:
    """Opens what arrives on one receiving socket (at `address`): MAC, then order, then msgpack."""

    def __init__(self, secret: str | None, channel: Channel, address: str) -> None:
        self._key = _key(secret, channel, address)
        self._last: OrderedDict[bytes, int] = OrderedDict()

    def open(self, data: bytes) -> dict:
        """The message, or AuthError (with its reason) when it must be dropped."""
        if len(data) < SEAL_OVERHEAD:
            raise AuthError(Rejection.MISSING_MAC, f"a {len(data)}-byte frame")
        if len(data) > MAX_FRAME_BYTES:
            raise AuthError(Rejection.MALFORMED, f"a {len(data)}-byte frame")
        view = memoryview(data)
        mac = hmac.new(self._key, view[TAG_BYTES:SEAL_OVERHEAD], hashlib.sha256)
        mac.update(view[SEAL_OVERHEAD:])
        if not hmac.compare_digest(view[:TAG_BYTES], mac.digest()):
            raise AuthError(Rejection.BAD_MAC)
        sender, seq = PREFIX.unpack_from(view, TAG_BYTES)
        last = self._last.get(sender)
        if last is not None and seq <= last:
            raise AuthError(Rejection.REPLAYED, f"sequence {seq} <= {last}")
        self._last[sender] = seq
        self._last.move_to_end(sender)
        while len(self._last) > MAX_SENDERS:
            self._last.popitem(last=False)
        try:
            return unpack(view[SEAL_OVERHEAD:])
        except ProtocolError as exc:
            raise AuthError(Rejection.MALFORMED, str(exc)) from None


class RejectionLog:
    """Logs dropped messages without letting a flood flood the log: the 1st, 2nd, 4th, 8th, ... of each reason."""

    def __init__(self, who: str) -> None:
        self._who = who
        self._counts: dict[Rejection, int] = {}

    def note(self, error: AuthError) -> None:
        count = self._counts[error.reason] = self._counts.get(error.reason, 0) + 1
        if count & (count - 1) == 0:
            logger.warning("%s: dropped a control message (%s; %d so far)", self._who, error, count)


def pack(message: dict) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(data: bytes | memoryview) -> dict:
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"control message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        message = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError) as exc:
        raise ProtocolError(f"undecodable control message: {exc}") from None
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise ProtocolError("control message must be a map with a string 'type'")
    return message


def params_to_wire(params: SamplingParams) -> dict:
    return asdict(params)


def params_from_wire(data: dict) -> SamplingParams:
    fields = SamplingParams.__dataclass_fields__
    unknown = set(data) - set(fields)
    if unknown:
        raise ProtocolError(f"unknown sampling fields {sorted(unknown)}")
    params = SamplingParams(**data)
    params.validate()
    return params
