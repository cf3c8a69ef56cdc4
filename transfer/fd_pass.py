"""A decode worker's KV cache handed to a same-node sender as file descriptors over a Unix socket (SCM_RIGHTS), not
opened through /proc/<pid>/fd: a worker is not dumpable (worker/hardening.py), so its /proc entries are closed to the
other processes of its user, and only a process that proves the cache's token gets the cache.

    receiver (FdServer, its own thread)              sender (fetch_fds)
    accept; the peer's uid (SO_PEERCRED) is ours
    challenge: 16 random bytes                 --->
                                               <---  HMAC-SHA256(token, LABEL | challenge)
    checked in constant time; then "ok" with a
    fresh file description of each descriptor  --->  the descriptors, checked by the caller (kv_segment.py)

The socket lives in the user's 0700 folder (transfer/private_dir.py), so another user cannot connect at all; the token
travels only in the MACed welcome of a KV session. One peer is served at a time, for at most HANDOFF_TIMEOUT_S: a peer
that stalls holds the socket no longer than that.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import re
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

from transfer.private_dir import runtime_dir
from transfer.shm_ring import left_behind

log = logging.getLogger(__name__)

LABEL = b"pdserve/v1/kv-cache-fds"
CHALLENGE_BYTES = 16
PROOF_BYTES = 32
HANDOFF_TIMEOUT_S = 2.0  # one peer's whole exchange, either side
ACCEPT_POLL_S = 0.25  # how often the serving thread looks whether it was closed
BACKLOG = 8
NAME_RE = re.compile(r"^kvc-[0-9]{1,10}-[0-9a-f]{16}\.sock$")
_UCRED = struct.Struct("3i")  # pid, uid, gid


class FdPassError(Exception):
    """The descriptors could not be fetched: no such socket, another user's, a refused proof, a timeout."""


def proof(token: bytes, challenge: bytes) -> bytes:
    return hmac.new(token, LABEL + challenge, hashlib.sha256).digest()


def peer_uid(sock: socket.socket) -> int:
    _, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return uid


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise FdPassError("the peer closed the connection mid-exchange")
        data += chunk
    return data


def sweep_stale(folder: Path, now: float | None = None) -> int:
    """Unlink the socket files of receivers that died without closing (SIGKILL): ``left_behind``."""
    now = time.time() if now is None else now
    gone = 0
    for entry in folder.iterdir():
        if not NAME_RE.match(entry.name):
            continue
        try:
            if not left_behind(int(entry.name.split("-")[1]), entry.lstat(), now):
                continue
        except OSError:
            continue
        with contextlib.suppress(OSError):
            entry.unlink()
            gone += 1
    return gone


class FdServer:
    """Serves ``open_fds()`` (fresh descriptors, closed here once sent) to peers that prove ``token``."""

    def __init__(self, token: bytes, open_fds: Callable[[], list[int]]) -> None:
        self._token, self._open_fds = token, open_fds
        folder = runtime_dir()
        sweep_stale(folder)
        self.path = str(folder / f"kvc-{os.getpid()}-{secrets.token_hex(8)}.sock")
        self.refused = 0  # peers of another user, or that did not prove the token
        self.served = 0
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(self.path)
            os.chmod(self.path, 0o600)
            self._sock.listen(BACKLOG)
        except OSError:
            self._sock.close()
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            raise
        self._sock.settimeout(ACCEPT_POLL_S)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-fds", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed under us
            with conn:
                try:
                    self._answer(conn)
                except (OSError, FdPassError) as e:
                    self.refused += 1
                    log.warning("a KV cache hand-off failed: %s", e)

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(HANDOFF_TIMEOUT_S)
        uid = peer_uid(conn)
        if uid != os.getuid():
            raise FdPassError(f"a process of uid {uid} asked for the KV cache")
        challenge = os.urandom(CHALLENGE_BYTES)
        conn.sendall(challenge)
        if not hmac.compare_digest(_recv_exact(conn, PROOF_BYTES), proof(self._token, challenge)):
            raise FdPassError("a peer did not prove the KV cache's token")
        fds = self._open_fds()
        try:
            socket.send_fds(conn, [b"ok"], fds)
        finally:
            for fd in fds:
                os.close(fd)
        self.served += 1

    def close(self) -> None:
        self._closed.set()
        self._sock.close()
        self._thread.join(timeout=2 * ACCEPT_POLL_S + HANDOFF_TIMEOUT_S)
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def check_path(path: object) -> str:
    """A socket path from an announcement: absolute, of our naming, short enough for AF_UNIX."""
    if not (isinstance(path, str) and path.startswith("/") and len(path) < 100 and NAME_RE.match(Path(path).name)):
        raise FdPassError(f"not a KV cache socket: {path!r:.120}")
    return path


def fetch_fds(path: str, token: bytes, count: int) -> list[int]:
    """The `count` descriptors the receiver at `path` hands to a prover of `token`; the caller owns them."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(HANDOFF_TIMEOUT_S)
        try:
            sock.connect(check_path(path))
            if peer_uid(sock) != os.getuid():
                raise FdPassError(f"{path} is served by another user")
            challenge = _recv_exact(sock, CHALLENGE_BYTES)
            sock.sendall(proof(token, challenge))
            msg, fds, flags, _ = socket.recv_fds(sock, 16, count)
        except OSError as e:
            raise FdPassError(f"no KV cache from {path}: {e}") from None
    if msg != b"ok" or len(fds) != count or flags & socket.MSG_CTRUNC:
        for fd in fds:
            os.close(fd)
        raise FdPassError(f"{path} refused the token or sent {len(fds)} descriptors, not {count}")
    return fds
