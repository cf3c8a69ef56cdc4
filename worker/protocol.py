"""Sealing of control-plane messages between the router and the workers: HMAC over msgpack, never pickle.

What the messages are (one typed Struct per kind, commands router -> worker and events worker -> router) is
``worker/messages.py``; this module authenticates them. Workers detokenize (``engine.detokenizer``, in the engine):
a ``tokens`` item's text is what the tokens add to the request's output, ready to send to the client; the router
only relays it.

Every message is sealed (``Signer.seal``) and opened (``Verifier.open``) here and nowhere else. A frame is
``tag(32) | sender(8) | seq(8) | msgpack body`` with ``tag = HMAC-SHA256(key, sender | seq | body)``; the receiver
checks the tag with ``hmac.compare_digest`` before msgpack sees a byte, and only then decodes the body into the
typed message (``decode_command`` or ``decode_event``, by the socket's direction; what does not decode is
``Rejection.MALFORMED``), so a stranger who can reach a socket cannot make a worker reserve, prefill, generate or
abort, nor feed the router tokens, finishes or heartbeats. The key is
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

from worker.messages import (
    MAX_MESSAGE_BYTES,
    Command,
    Event,
    MalformedMessage,
    ProtocolError,
    decode_command,
    decode_event,
    encode,
)

logger = logging.getLogger(__name__)

TAG_BYTES = 32
PREFIX = struct.Struct(">8sQ")  # sender id, sequence number
SEAL_OVERHEAD = TAG_BYTES + PREFIX.size
MAX_FRAME_BYTES = MAX_MESSAGE_BYTES + SEAL_OVERHEAD  # zmq.MAXMSGSIZE of every control socket
MAX_SENDERS = 4096  # senders whose last sequence number a receiver remembers (least recently heard forgotten first)


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

    def seal(self, message: Command | Event) -> bytes:
        return self.seal_body(encode(message))

    def seal_body(self, body: bytes) -> bytes:
        """Seal an encoded message as it is (tests use it to send what no Struct encodes to)."""
        prefix = PREFIX.pack(self._sender, next(self._seq))
        mac = hmac.new(self._key, prefix, hashlib.sha256)
        mac.update(body)
        return b"".join((mac.digest(), prefix, body))


class Verifier:
    """Opens what arrives on one receiving socket (at `address`): MAC, then order, then the typed message (commands
    on a worker's command socket, events on the router's event socket)."""

    def __init__(self, secret: str | None, channel: Channel, address: str) -> None:
        self._key = _key(secret, channel, address)
        self._last: OrderedDict[bytes, int] = OrderedDict()
        self._decode = decode_command if channel is Channel.COMMANDS else decode_event

    def open(self, data: bytes) -> Command | Event:
        """The typed message, or AuthError (with its reason) when it must be dropped."""
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
            return self._decode(view[SEAL_OVERHEAD:])
        except MalformedMessage as exc:
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
