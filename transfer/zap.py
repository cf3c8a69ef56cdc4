"""The first gate of every ZeroMQ socket of the control and KV planes: a peer that cannot show it holds the cluster
secret is dropped in ZeroMQ's own handshake, before libzmq buffers a byte it sends (a stranger's never-ending
multipart message, its huge frames and routing ids never reach a queue). The MACs behind it (transfer/auth.py,
worker/protocol.py) stay: they bind each message to its socket, its sender and its order.

ZeroMQ asks the process's ZAP handler (RFC 27, ``inproc://zeromq.zap.01`` of the socket's context) about every
connecting peer; ``ZapHandler`` answers from keys derived from the secret:
- control sockets (router <-> workers) run CURVE: the server keys and the one client key all derive from the secret,
  and the handler admits only that client key. Control messages are small, so encrypting them costs nothing measurable.
- KV sockets run PLAIN with a password derived from the secret. CURVE would also encrypt the KV payload, at a quarter of
  the plain throughput on loopback (docs/transfer.md); the KV plane's own handshake MACs each session with fresh
  nonces, so the password only decides who may speak that handshake.
A peer's routing id (which libzmq keeps for as long as it is connected) comes in the handshake's last step, after
ZAP has admitted it: a stranger never gets to send one. Without a handler bound, libzmq would admit any CURVE client:
``ZapHandler`` is started before the socket binds.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import logging
import operator
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.utils.z85
from zmq.utils.monitor import parse_monitor_message

from transfer.auth import derive_key

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = "pdserve"
PLAIN_USER = b"pdserve"
POLL_MS = 100  # how often the handler's thread looks at its stop flag


@dataclass(frozen=True, slots=True)
class PlaneKeys:
    """CURVE keys (Z85) of the control plane and the KV plane's PLAIN password, all derived from the cluster secret."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes
    kv_password: bytes

    @property
    def client_public_raw(self) -> bytes:
        return zmq.utils.z85.decode(self.client_public)


@functools.cache
def plane_keys(secret: str | None) -> PlaneKeys:
    """The keys of a cluster secret (None: a transfer built without one, whose keys, like its KV handshake's, anyone
    can derive; the launcher always makes a secret)."""

    def derived(label: str) -> bytes:
        return derive_key(secret or "", f"pdserve/v1/zmq/{label}".encode())

    server_secret = zmq.utils.z85.encode(derived("curve-server"))
    client_secret = zmq.utils.z85.encode(derived("curve-client"))
    return PlaneKeys(
        server_public=zmq.curve_public(server_secret),
        server_secret=server_secret,
        client_public=zmq.curve_public(client_secret),
        client_secret=client_secret,
        kv_password=derived("kv-password").hex().encode(),
    )


def serve_curve(sock: zmq.Socket, keys: PlaneKeys) -> None:
    """A control socket that binds: CURVE server, its peers vetted by the context's ``ZapHandler``."""
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)


def connect_curve(sock: zmq.Socket, keys: PlaneKeys) -> None:
    """A control socket that connects: the cluster's CURVE client key."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)


def serve_plain(sock: zmq.Socket) -> None:
    """A KV socket that binds: PLAIN server, its peers vetted by the context's ``ZapHandler``."""
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
    sock.setsockopt(zmq.PLAIN_SERVER, 1)


def connect_plain(sock: zmq.Socket, keys: PlaneKeys) -> None:
    """A KV socket that connects: the cluster's PLAIN password."""
    sock.setsockopt(zmq.PLAIN_USERNAME, PLAIN_USER)
    sock.setsockopt(zmq.PLAIN_PASSWORD, keys.kv_password)


FAILED_HANDSHAKES: dict[int, str] = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "auth",  # this handler refused its key or password
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol",  # it spoke another mechanism (a stranger without keys), or garbage
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "no_detail",  # it failed otherwise (a key that does not decrypt)
}


class ZapHandler:
    """Answers the ZAP requests of one ZeroMQ context on a thread of its own, and watches the handshakes of the
    server sockets given to ``watch``: ``refused`` counts the peers dropped there (its thread is the only writer; the
    1st, 2nd, 4th, ... are logged), and ``on_refused(reason)`` hears of each (``FAILED_HANDSHAKES``)."""

    def __init__(
        self, ctx: zmq.Context, keys: PlaneKeys, name: str, on_refused: Callable[[str], None] | None = None
    ) -> None:
        # a plain context on the same libzmq one (an asyncio context's too): inproc endpoints are per libzmq context
        self._ctx: zmq.Context = zmq.Context.shadow(ctx.underlying)
        self._keys = keys
        self._client_key = keys.client_public_raw
        self._on_refused = on_refused
        self._name = name
        self.refused = 0
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._watch: queue.SimpleQueue[str] = queue.SimpleQueue()  # monitor endpoints for the thread to read
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"{name}-zap", daemon=True)
        self._thread.start()
        if not self._bound.wait(10.0) or self._error is not None:
            raise RuntimeError(f"the ZAP handler did not start: {self._error}")

    def _run(self) -> None:
        try:
            sock = self._ctx.socket(zmq.REP)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as exc:  # another handler holds this context's endpoint
            self._error = exc
            self._bound.set()
            return
        self._bound.set()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        monitors: list[zmq.Socket] = []
        try:
            while not self._stop.is_set():
                while not self._watch.empty():
                    monitor = self._ctx.socket(zmq.PAIR)
                    monitor.setsockopt(zmq.LINGER, 0)
                    monitor.connect(self._watch.get())
                    monitors.append(monitor)
                    poller.register(monitor, zmq.POLLIN)
                for ready, _ in poller.poll(POLL_MS):
                    if ready is sock:
                        sock.send_multipart(self._answer(sock.recv_multipart()))
                    else:
                        self._note_failure(ready.recv_multipart())
        finally:
            for monitor in monitors:
                monitor.close(0)
            sock.close(0)

    def watch(self, server: zmq.Socket) -> None:
        """Count the peers that fail ``server``'s handshake (call it before ``server`` binds; from its own thread)."""
        endpoint = f"inproc://pdserve-handshakes-{id(server):x}"
        server.monitor(endpoint, functools.reduce(operator.or_, FAILED_HANDSHAKES))
        self._watch.put(endpoint)

    def _note_failure(self, message: list[bytes]) -> None:
        event = parse_monitor_message(message)["event"]
        reason = FAILED_HANDSHAKES.get(int(event))
        if reason is None:
            return
        self.refused += 1
        if self.refused & (self.refused - 1) == 0:  # a flood cannot flood the log
            log.warning("%s: refused a peer in the handshake (%s; %d so far)", self._name, reason, self.refused)
        if self._on_refused is not None:
            self._on_refused(reason)

    def _answer(self, request: list[bytes]) -> list[bytes]:
        if len(request) < 6:
            return [b"1.0", b"", b"400", b"malformed ZAP request", b"", b""]
        version, request_id, _domain, _address, _identity, mechanism, *credentials = request
        reason = self._refusal(mechanism, credentials)  # a refusal is counted by its handshake's failure event
        if reason is None:
            return [version, request_id, b"200", b"OK", b"", b""]
        return [version, request_id, b"400", reason.encode(), b"", b""]

    def _refusal(self, mechanism: bytes, credentials: list[bytes]) -> str | None:
        if mechanism == b"CURVE":
            ok = bool(credentials) and hmac.compare_digest(credentials[0], self._client_key)
            return None if ok else "unknown_key"
        if mechanism == b"PLAIN":
            ok = (
                len(credentials) == 2
                and hmac.compare_digest(credentials[0], PLAIN_USER)
                and hmac.compare_digest(credentials[1], self._keys.kv_password)
            )
            return None if ok else "bad_password"
        return "mechanism"

    def close(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        with contextlib.suppress(RuntimeError):
            self._thread.join(timeout_s)
