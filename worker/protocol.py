"""Sealing of control-plane messages between the router and the workers: HMAC over msgpack, never pickle.

``Signer.seal`` seals a typed message (worker/messages.py) with transfer/auth.py's ``seal``, the KV plane's frame
``tag(32) | sender(16) | seq(8) | body``; ``Verifier.open`` checks the MAC before msgpack sees a byte, then the order,
then decodes the body into the socket's direction (commands or events). The key is derived from the cluster secret,
the direction and the receiving socket's address (with a random value of its start: ``with_start_value``), so a
message is valid only at the socket and in the process it was sent to; ``sender``
is random per sending socket and ``seq`` strictly increases on it, so a replayed message is refused. What is dropped
is an AuthError with its ``Rejection``, counted by the worker (``control_rejected``) and the router
(``pdserve_control_rejected_total``).
"""

from __future__ import annotations

import enum
import itertools
import logging
import os
import secrets
from collections import OrderedDict

from transfer.auth import IDENT_BYTES, OVERHEAD, derive_key, seal, split, verify
from transfer.errors import AuthError
from worker.messages import MAX_MESSAGE_BYTES, Command, Event, MalformedMessage, decode_command, decode_event, encode

logger = logging.getLogger(__name__)

SEAL_OVERHEAD = OVERHEAD
MAX_FRAME_BYTES = MAX_MESSAGE_BYTES + SEAL_OVERHEAD  # the ceiling; each receiving socket's bound: frame_bound()
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
    HANDSHAKE = "handshake"  # a peer without the cluster's keys, dropped in ZeroMQ's handshake (transfer/zap.py)


def rejected(reason: Rejection, detail: str = "") -> AuthError:
    """A control message to drop: before it was unpacked, or (MALFORMED) after it was authenticated."""
    return AuthError(f"{reason.value}{': ' + detail if detail else ''}", reason=reason)


def with_start_value(endpoint: str) -> str:
    """A receiving socket's address as it is announced: its ZeroMQ endpoint and a random value of this start, after
    ``#``. Keys derive from the whole address, so a restarted worker or router (even on the same port, with the same
    configured secret) never accepts what was sealed for its predecessor."""
    return f"{endpoint}#{secrets.token_hex(8)}"


def zmq_endpoint(address: str) -> str:
    """What ZeroMQ connects to: the address without its start value."""
    return address.partition("#")[0]


def frame_bound(max_message_bytes: int) -> int:
    """A receiving socket's zmq.MAXMSGSIZE for messages of at most ``max_message_bytes``: ZeroMQ drops a peer that
    sends a larger frame before buffering it."""
    return min(max_message_bytes, MAX_MESSAGE_BYTES) + SEAL_OVERHEAD


def control_key(secret: str | None, channel: Channel, address: str) -> bytes:
    if not secret:
        raise ValueError("the control plane needs the cluster secret (transfer.secret; the launcher makes one)")
    return derive_key(secret, f"pdserve/v1/control/{channel.value}/{address}".encode())


class Signer:
    """Seals the messages one sending socket sends to `address` (the receiving socket's address)."""

    def __init__(self, secret: str | None, channel: Channel, address: str) -> None:
        self._key = control_key(secret, channel, address)
        self._sender = os.urandom(IDENT_BYTES)
        self._seq = itertools.count(1)  # next() is atomic under the GIL

    def seal(self, message: Command | Event) -> bytes:
        return self.seal_body(encode(message))

    def seal_body(self, body: bytes) -> bytes:
        """Seal an encoded message as it is (tests use it to send what no Struct encodes to)."""
        return seal(self._key, self._sender, next(self._seq), body)


class Verifier:
    """Opens what arrives on one receiving socket (at `address`): size, MAC, then order, then the typed message
    (commands on a worker's command socket, events on the router's event socket), each at most `max_message_bytes`
    (the largest real one: ``max_command_bytes``, ``max_event_bytes``)."""

    def __init__(
        self, secret: str | None, channel: Channel, address: str, max_message_bytes: int = MAX_MESSAGE_BYTES
    ) -> None:
        self._key = control_key(secret, channel, address)
        self._last: OrderedDict[bytes, int] = OrderedDict()
        self._decode = decode_command if channel is Channel.COMMANDS else decode_event
        self.max_frame_bytes = frame_bound(max_message_bytes)

    def open(self, data: bytes) -> Command | Event:
        """The typed message, or AuthError (with its reason) when it must be dropped."""
        if len(data) < SEAL_OVERHEAD:
            raise rejected(Rejection.MISSING_MAC, f"a {len(data)}-byte frame")
        if len(data) > self.max_frame_bytes:
            raise rejected(Rejection.MALFORMED, f"a {len(data)}-byte frame over {self.max_frame_bytes}")
        if not verify(self._key, data):
            raise rejected(Rejection.BAD_MAC)
        _, sender, seq, body = split(data)
        last = self._last.get(sender)
        if last is not None and seq <= last:
            raise rejected(Rejection.REPLAYED, f"sequence {seq} <= {last}")
        self._last[sender] = seq
        self._last.move_to_end(sender)
        while len(self._last) > MAX_SENDERS:
            self._last.popitem(last=False)
        try:
            return self._decode(body)
        except MalformedMessage as exc:
            raise rejected(Rejection.MALFORMED, str(exc)) from None


class RejectionLog:
    """Logs dropped messages without letting a flood flood the log: the 1st, 2nd, 4th, 8th, ... of each reason."""

    def __init__(self, who: str) -> None:
        self._who = who
        self._counts: dict[enum.Enum | None, int] = {}  # None: an AuthError off the KV plane

    def note(self, error: AuthError) -> None:
        count = self._counts[error.reason] = self._counts.get(error.reason, 0) + 1
        if count & (count - 1) == 0:
            logger.warning("%s: dropped a control message (%s; %d so far)", self._who, error, count)
