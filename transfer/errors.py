"""Typed failures of a KV transfer.

Every way a transfer can go wrong maps to one subclass of `TransferError`, so the prefill and decode
workers can count failures by kind (metrics) and free blocks through one cleanup path. Errors travel back
to the producer by *name* inside a NACK header (`error_from_code`), never as pickled objects. `ProtocolError` and
`AuthError` are the control plane's too (worker/messages.py, worker/protocol.py).
"""

from __future__ import annotations

import enum


class TransferError(Exception):
    """Base class: this transfer failed; its blocks must be freed on both sides."""

    code = "transfer_error"
    from_peer = False  # True when the other side decided the failure (a NACK or a reject): it reports it itself


class ProtocolError(TransferError):
    """The peer sent something that does not follow the wire format (bad header, sizes, order), on either plane."""

    code = "protocol"


class AuthError(ProtocolError):
    """A frame whose MAC is missing or wrong, or a replayed one (see transfer/auth.py): dropped before decoding.

    ``reason``: why the control plane dropped it (worker/protocol.py ``Rejection``); None on the KV plane."""

    code = "unauthenticated"

    def __init__(self, *args: object, reason: enum.Enum | None = None) -> None:
        super().__init__(*args)
        self.reason = reason


class ChecksumError(TransferError):
    """A payload frame's xxh3_64 differs from the one in its header: corrupted on the way."""

    code = "checksum"


class FingerprintMismatch(TransferError):
    """The two sides run different models / KV layouts; mixing their KV would be silently wrong."""

    code = "fingerprint"


class FrameTooLarge(TransferError):
    """A frame exceeds the receiver's `max_frame_bytes` bound; refused before it is buffered or used."""

    code = "frame_too_large"


class TransferTimeout(TransferError):
    """A deadline, lease, send timeout or full queue expired before the transfer completed."""

    code = "timeout"


class PeerGone(TransferError):
    """The peer is unreachable or died (no handshake, broken connection, unknown session)."""

    code = "peer_gone"


class SessionLimit(TransferError):
    """The receiver already holds `max_sessions` sender sessions: a new handshake is refused (not an old one evicted)
    until idle ones expire; the caller may try another decode worker."""

    code = "session_limit"


class TransferAborted(TransferError):
    """One of the sides called `abort(transfer_id)` (client gone, request cancelled)."""

    code = "aborted"


class SenderAborted(TransferAborted):
    """The producer aborted the transfer on purpose (its prefill failed, or its caller cancelled): the producer's
    side reports why, so the consumer only frees what it reserved."""

    code = "sender_aborted"


_BY_CODE: dict[str, type[TransferError]] = {
    cls.code: cls
    for cls in (
        TransferError,
        ProtocolError,
        AuthError,
        ChecksumError,
        FingerprintMismatch,
        FrameTooLarge,
        TransferTimeout,
        PeerGone,
        SessionLimit,
        TransferAborted,
        SenderAborted,
    )
}


def error_from_code(code: str, message: str) -> TransferError:
    """Rebuild a typed error from a NACK's or a reject's (code, message); unknown codes become plain TransferError.

    The error is marked ``from_peer``: the other side decided it, and reports it on its own side."""
    error = _BY_CODE.get(code, TransferError)(message)
    error.from_peer = True
    return error
