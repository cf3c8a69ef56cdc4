"""Authentication of the KV plane: both sides prove they hold the cluster secret without sending it, and every header
frame after that carries a MAC keyed per session (docs/transfer.md, "Authentication"). The sealing here (``seal``,
``verify``, ``split``) is the control plane's too (worker/protocol.py): there ``ident`` is the sending socket's random
id and the key is per socket.

A frame is ``tag(32) | ident(16) | seq(8, big-endian) | msgpack header``, ``tag = HMAC-SHA256(key, ident | seq |
header)``, checked in constant time before msgpack sees a byte. Hello, welcome and reject go under the handshake key
HMAC(secret, label) with ident 0; the rest under the session key HMAC(handshake key, nonce_s | rnonce | session), with
the session token as ident and seq strictly increasing.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections import OrderedDict

from transfer.errors import AuthError

TAG_BYTES = 32
IDENT_BYTES = 16
PREFIX = struct.Struct(f">{IDENT_BYTES}sQ")  # ident (a session token or a control sender id), sequence number
OVERHEAD = TAG_BYTES + PREFIX.size
NO_SESSION = bytes(IDENT_BYTES)
NONCE_BYTES = 16
_LABEL = b"pdserve/v1/kv-handshake"


def derive_key(secret: str, label: bytes) -> bytes:
    return hmac.digest(secret.encode(), label, hashlib.sha256)


def handshake_key(secret: str | None) -> bytes:
    return derive_key(secret or "", _LABEL)


def session_key(handshake: bytes, nonce_s: bytes, rnonce: bytes, session: bytes) -> bytes:
    return hmac.digest(handshake, b"session|" + nonce_s + rnonce + session, hashlib.sha256)


def pair_group_key(key: bytes) -> str:
    """Store prefix of a torch.distributed pair group: named by the session key, so only its two ends know it."""
    return "kvpair/" + hmac.digest(key, b"pair-group", hashlib.sha256).hex()[:40]


def pair_proof(key: bytes, rank: int) -> bytes:
    """What rank `rank` of a pair group sends its peer first, to show it holds the session key."""
    return hmac.digest(key, b"pair-proof|%d" % rank, hashlib.sha256)


def _tag(key: bytes, prefix: bytes | memoryview, body) -> bytes:
    mac = hmac.new(key, prefix, hashlib.sha256)
    mac.update(body)
    return mac.digest()


def seal(key: bytes, ident: bytes, seq: int, body: bytes) -> bytes:
    prefix = PREFIX.pack(ident, seq)
    return b"".join((_tag(key, prefix, body), prefix, body))


def split(data) -> tuple[memoryview, bytes, int, memoryview]:
    """(tag, ident, seq, body) of a frame, without trusting any of it; too short is an AuthError."""
    mv = memoryview(data)
    if mv.nbytes < OVERHEAD:
        raise AuthError(f"a {mv.nbytes}-byte frame has no MAC")
    ident, seq = PREFIX.unpack_from(mv, TAG_BYTES)
    return mv[:TAG_BYTES], ident, seq, mv[OVERHEAD:]


def verify(key: bytes, data) -> bool:
    """Constant-time check of a frame's tag under `key`."""
    mv = memoryview(data)
    if mv.nbytes < OVERHEAD:
        return False
    return hmac.compare_digest(mv[:TAG_BYTES], _tag(key, mv[TAG_BYTES:OVERHEAD], mv[OVERHEAD:]))


class NonceCache:
    """The hello nonces seen recently (bounded): a replayed hello is refused."""

    def __init__(self, size: int = 4096) -> None:
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._size = size

    def add(self, nonce: bytes) -> bool:
        """False if `nonce` was seen already."""
        if nonce in self._seen:
            return False
        self._seen[nonce] = None
        while len(self._seen) > self._size:
            self._seen.popitem(last=False)
        return True
