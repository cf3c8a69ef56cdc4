"""A two-rank torch.distributed group between one sender (rank 1) and one receiver (rank 0) process, and the thread
that runs its point-to-point sends and receives (docs/transfer.md, "nccl / gloo pair groups").

Each pair builds its own group (`ProcessGroupGloo` / `ProcessGroupNCCL` over a `PrefixStore` named by a MAC of the
session key) in the link thread at its first handshake, bounded by group_timeout_s; the receiver hosts one `TCPStore`
on its own address's host for all its pairs. The first exchange is a proof of the session key each way (TCPStore has
no authentication). Then the thread runs jobs in order: one piece's frames, a tag per frame, each wait bounded (gloo's
recv completes only inside wait()); on NCCL under the link's stream, after the job's `ready` event. Any failure breaks
the link: queued jobs fail with PeerGone and the group is aborted, so no op outlives a dead peer (NCCL's watchdog is
off: transfer/nccl_env.py); a crash of the thread itself is reported to `on_crash` (the owner's io_problem()).
"""

from __future__ import annotations

import contextlib
import datetime
import hmac
import logging
import os
import queue
import socket
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from transfer import nccl_env
from transfer.auth import pair_proof
from transfer.errors import AuthError, PeerGone, TransferError

log = logging.getLogger(__name__)
PROOF_TAG = (1 << 30) + 1  # beyond every job tag (next_tags wraps at 2**30)
_WARNED_ENV = threading.Event()  # the missing NCCL settings are logged once per process
ABORTS = {"count": 0}  # pair groups aborted after a failed or timed-out op (process-wide, for logs and tests)


@dataclass(slots=True)
class LinkJob:
    transfer_id: str
    tensors: list[torch.Tensor]
    tags: tuple[int, ...]
    piece: Any = None  # receiver: the PieceHeader these tensors complete
    # torch.cuda.Event the link's stream waits on first; after a receive, the one the consumer waits on
    ready: Any = None


def host_of(address: str) -> str:
    """Host part of a zmq address; ipc:// and wildcard binds mean this node (loopback)."""
    if address.startswith("tcp://"):
        host = address[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
        if host not in ("*", "0.0.0.0", "", "::"):
            return host
    return "127.0.0.1"


def local_ip_towards(host: str) -> str:
    """The local interface address that routes to `host` (a UDP connect sends no packet)."""
    if host.startswith("127.") or host == "localhost":
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def make_store_server(host: str, timeout_s: float) -> dist.TCPStore:
    """Receiver-side rendezvous store on a free port of `host` only (shared by all its pair groups)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.bind((host, 0))
        listener.listen(128)
        port = listener.getsockname()[1]
    except OSError:
        listener.close()
        raise
    fd = listener.detach()  # the store owns it from here (and closes it)
    try:
        return dist.TCPStore(
            host,
            port,
            None,
            True,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=fd,
        )
    except BaseException:
        os.close(fd)
        raise


class PairLink:
    """One pair group plus the thread that runs its p2p jobs; see module docstring."""

    def __init__(
        self,
        *,
        backend: str,
        rank: int,
        key: str,
        store_host: str,
        store_port: int,
        local_host: str,
        timeout_s: float,
        auth_key: bytes,
        store: dist.Store | None = None,
        on_crash: Callable[[str], None] | None = None,
        device: str = "cpu",
    ) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"pair group backend must be gloo or nccl, not {backend!r}")
        self.backend, self.rank, self.key = backend, rank, key
        self.device = _link_device(backend, device)
        self.aborted = False  # the group was aborted after a failed or timed-out op
        self._auth_key = auth_key
        self._store_addr = (store_host, store_port)
        self._store = store
        self._local_host = local_host
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._jobs: queue.Queue[LinkJob] = queue.Queue()
        self._done: deque[tuple[LinkJob, TransferError | None]] = deque()
        self._tag = 0
        self.broken: TransferError | None = None
        self.crashed = ""  # what killed the thread, when it was not the peer (see _run)
        self._on_crash = on_crash
        self.ready = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-pair-{key[-8:]}", daemon=True)
        self._thread.start()

    def next_tags(self, n: int) -> tuple[int, ...]:
        tags = tuple((self._tag + i) % (1 << 30) for i in range(n))
        self._tag += n
        return tags

    def submit(self, job: LinkJob) -> None:
        if self.broken is not None:
            self._done.append((job, self.broken))
        else:
            self._jobs.put(job)

    def pop_done(self) -> list[tuple[LinkJob, TransferError | None]]:
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, join_s: float = 2.0) -> None:
        """Stop the thread and let it destroy the group (a group alive at interpreter exit aborts it)."""
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(join_s)

    def _build(self) -> Any:
        store = self._store or dist.TCPStore(
            self._store_addr[0], self._store_addr[1], None, False, timeout=self._timeout
        )
        prefixed = dist.PrefixStore(self.key, store)
        if self.backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private: no stub; sets the timeout
            opts._timeout = self._timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self._local_host)]
            return dist.ProcessGroupGloo(prefixed, self.rank, 2, opts)
        if not dist.is_nccl_available():
            raise RuntimeError("this torch build has no NCCL")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = self._timeout
        _warn_unless_nccl_env()
        return dist.ProcessGroupNCCL(prefixed, self.rank, 2, opts)

    def _prove(self, pg: Any) -> None:
        """Exchange proofs of the session key (rank 0 receives first, so NCCL's ordered p2p cannot deadlock)."""
        device = self.device
        mine = torch.tensor(list(pair_proof(self._auth_key, self.rank)), dtype=torch.uint8, device=device)
        theirs = torch.zeros(len(mine), dtype=torch.uint8, device=device)
        peer = 1 - self.rank
        for op, t in ((pg.recv, theirs), (pg.send, mine)) if self.rank == 0 else ((pg.send, mine), (pg.recv, theirs)):
            op([t], peer, PROOF_TAG).wait(self._timeout)
        if not hmac.compare_digest(bytes(theirs.cpu().tolist()), pair_proof(self._auth_key, peer)):
            raise AuthError("the pair group's peer does not hold the session key")

    def _run(self) -> None:
        """The thread's top level: nothing leaves it silently."""
        try:
            self._serve()
        except BaseException as e:  # noqa: BLE001 - recorded, reported, and the link's transfers fail
            self.crashed = f"{type(e).__name__}: {e}"[:300]
            log.exception("kv pair-link thread died")
            self._break(PeerGone(f"{self.backend} pair link failed: {self.crashed}"))
            if self._on_crash is not None:
                self._on_crash(self.crashed)

    def _serve(self) -> None:
        stream = None
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # this thread's ops (and NCCL's communicator) on the worker's GPU
            stream = torch.cuda.Stream(device=self.device)
        try:
            pg = self._build()
        except Exception as e:  # noqa: BLE001 - reported as a typed transfer failure
            self._break(PeerGone(f"{self.backend} pair group not formed within {self._timeout.total_seconds()}s: {e}"))
            return
        try:
            self._prove(pg)
        except Exception as e:  # noqa: BLE001
            self._abort(pg, str(e))
            why = f"{self.backend} pair group: no proof of the session key from the peer: {str(e)[:300]}"
            self._break(e if isinstance(e, AuthError) else PeerGone(why))
            return
        self.ready.set()
        peer = 1 - self.rank
        while not self._stop.is_set():
            try:
                job = self._jobs.get(timeout=0.05)
            except queue.Empty:
                continue
            try:
                self._exchange(pg, job, peer, stream)
            except Exception as e:  # noqa: BLE001 - a dead, frozen or lying peer: this pair only
                err = PeerGone(f"{self.backend} p2p with the peer failed: {str(e)[:300]}")
                self._abort(pg, str(e))
                self.broken = self.broken or err  # first: whoever sees the failed job sees the link broken too
                self._done.append((job, err))
                self._break(err)
                return
            self._done.append((job, None))
        self._shutdown(pg)
        self._break(PeerGone("pair link closed"))

    def _exchange(self, pg: Any, job: LinkJob, peer: int, stream: Any) -> None:
        """One job's sends (rank 1) or receives (rank 0), each wait bounded. On CUDA under the link's stream, after
        the job's `ready` event; a receive leaves a new `ready` event for the consumer."""
        op = pg.send if self.rank == 1 else pg.recv
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if stream is not None and job.ready is not None:
                stream.wait_event(job.ready)
            works = [op([t], peer, tag) for t, tag in zip(job.tensors, job.tags)]
            for w in works:
                w.wait(self._timeout)
            if stream is not None:
                done = torch.cuda.Event()
                done.record(stream)
                job.ready = done if self.rank == 0 else None

    def _abort(self, pg: Any, why: str) -> None:
        """Tear the group down after a failed op: nothing of it may keep waiting on the peer (see module docstring)."""
        self.aborted = True
        ABORTS["count"] += 1
        log.warning("aborting the %s pair group %s after a failed op: %s", self.backend, self.key[-8:], why[:200])
        try:
            pg.abort()
        except Exception:  # noqa: BLE001 - the group is dropped either way
            log.exception("aborting a %s pair group", self.backend)

    def _shutdown(self, pg: Any) -> None:
        """Orderly end of a healthy group (NCCL frees its communicator here rather than at interpreter exit)."""
        if self.backend == "nccl":
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001 - a group that cannot shut down cleanly is aborted instead
                self._abort(pg, "shutdown failed")

    def _break(self, err: TransferError) -> None:
        self.broken = self.broken or err
        while True:
            try:
                self._done.append((self._jobs.get_nowait(), self.broken))
            except queue.Empty:
                return


def _warn_unless_nccl_env() -> None:
    """The process was started without pdserve's NCCL settings (transfer/nccl_env.py): say so, once. Never set
    them here: other threads of this process read the environment."""
    wrong = nccl_env.missing()
    if wrong and not _WARNED_ENV.is_set():
        _WARNED_ENV.set()
        log.warning(
            "building an NCCL pair group in a process started without %s: a pair's timed-out op may abort this "
            "whole process later; start workers through pdserve, or call transfer.nccl_env.set_at_process_start() "
            "before any thread runs",
            ", ".join(f"{name}={value}" for name, value in nccl_env.NCCL_PROCESS_ENV.items() if name in wrong),
        )


def _link_device(backend: str, device: str) -> torch.device:
    """gloo moves host tensors; NCCL the worker's GPU ("cuda" without an index: the current device)."""
    if backend == "gloo":
        return torch.device("cpu")
    dev = torch.device(device if device.startswith("cuda") else "cuda")
    if dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev
