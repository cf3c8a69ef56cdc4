"""The shared-memory ring of the `shm` backend: one file in /dev/shm per sender session, created by the receiver
(docs/transfer.md, "Same-node shared memory").

The receiver picks name, size and a random token and announces them in its MACed welcome; the sender maps only a file
holding that token and unlinks the name at once, so nothing can be left behind. Page 0 is the control page: magic (8)
| token (16) | data size (u64) ... | tail (u64 at offset 64, written only by the receiver); the data area follows.
Positions are virtual (ever-increasing u64; byte p lives at p % size): the sender places each frame at its head,
64-byte aligned, never wrapping inside a frame, while `end - tail <= size`; the receiver checks a piece's positions
against its own tail and size before it views a byte (`check_positions`), and advances `tail` once the sink copied it.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import mmap
import os
import re
import secrets
import socket
import stat
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from transfer.errors import ProtocolError

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "pdserve-kv-"
NAME_RE = re.compile(r"^pdserve-kv-[0-9]{1,10}-[0-9a-f]{32}$")
MAGIC = b"PDSVKVR1"
PAGE = 4096
ALIGN = 64
TAIL_AT = 64
_HEAD = struct.Struct("<8s16sQ")
_U64 = struct.Struct("<Q")
MAX_POSITION = 1 << 62
MIN_RING_BYTES = 1 << 16
MAX_RING_BYTES = 1 << 34
STALE_AGE_S = 30.0  # a dead receiver's segment is swept only once this old (another pid namespace may share /dev/shm)
_MADV_POPULATE_READ, _MADV_POPULATE_WRITE = 22, 23  # Linux >= 5.14; older kernels: pages are touched instead
_fence_lock = threading.Lock()


class ShmUnavailable(Exception):
    """No ring for this session (not on the receiver's node, /dev/shm full or absent, too many rings): the pieces go
    inline over ZeroMQ instead, like the zmq backend."""


def _fence() -> None:
    """A full memory barrier (a lock's acquire and release), so that the sink's reads of a region are complete before
    the tail store that lets the sender overwrite it (x86 orders them anyway; weaker CPUs need the barrier)."""
    with _fence_lock:
        pass


@functools.cache
def node_id() -> str:
    """Who shares this host's /dev/shm: boot id, host name and the identity of the /dev/shm mount (containers with a
    private /dev/shm differ). Equal ids are only a hint to try: the sender still proves it by mapping the ring."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read().strip()
    except OSError:
        boot = b""
    try:
        st = os.stat(SHM_DIR)
        mount = f"{st.st_dev}:{st.st_ino}".encode()
    except OSError:
        mount = b"no-shm"
    return hashlib.sha256(b"|".join((boot, socket.gethostname().encode(), mount))).hexdigest()[:32]


def _populate(mm: mmap.mmap, advice: int) -> None:
    """Fault the mapping in once, at the session's start, not during the first transfer."""
    try:
        mm.madvise(advice)
    except (OSError, ValueError, AttributeError):
        view = torch.frombuffer(mm, dtype=torch.uint8)
        view[::PAGE].sum()  # a read per page maps it (the pages are allocated already: posix_fallocate)
        del view


def place(head: int, sizes: Sequence[int], ring_size: int) -> list[int]:
    """Positions of frames of `sizes` bytes written from virtual position `head`, then their end: 64-byte aligned,
    a frame that would cross the ring's end starts at the next lap. The receiver checks positions, never recomputes
    them, so a lost message cannot desynchronize the two sides."""
    out = []
    pos = head
    for n in sizes:
        pos = -(-pos // ALIGN) * ALIGN
        if pos % ring_size + n > ring_size:
            pos = (pos // ring_size + 1) * ring_size
        out.append(pos)
        pos += n
    out.append(pos)
    return out


def check_positions(where: Any, sizes: Sequence[int], tail: int, ring_size: int) -> list[int]:
    """The data offsets of a piece's frames, once its positions (from the network) are proven to lie inside this
    ring, after everything released, within one lap of it, in order and without overlap; else a ProtocolError."""
    if not (
        isinstance(where, list)
        and len(where) == len(sizes) + 1
        and all(isinstance(p, int) and not isinstance(p, bool) and 0 <= p < MAX_POSITION for p in where)
    ):
        raise ProtocolError(f"malformed shm positions {where!r:.100}")
    end = where[-1]
    if end - tail > ring_size:
        raise ProtocolError(
            f"shm region ends {end - tail} bytes past the released tail: more than the ring's {ring_size}"
        )
    offsets = []
    floor = tail
    for pos, n in zip(where, sizes):
        if pos < floor or pos + n > end or pos % ring_size + n > ring_size:
            raise ProtocolError(f"shm frame at {pos} ({n} bytes) outside the ring's free region [{floor}, {end})")
        offsets.append(pos % ring_size)
        floor = pos + n
    return offsets


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def _unlink(name: str) -> None:
    try:
        os.unlink(_path(name))
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("could not unlink shared-memory segment %s: %s", name, e)


class RingOwner:
    """Receiver side of one session's ring: creates it, views checked regions of it, releases them."""

    def __init__(self, size: int) -> None:
        if not MIN_RING_BYTES <= size <= MAX_RING_BYTES:
            raise ValueError(f"ring size {size} out of [{MIN_RING_BYTES}, {MAX_RING_BYTES}]")
        self.size = size
        self.token = secrets.token_bytes(16)
        self.name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(16)}"
        self.tail = 0
        self._closed = False
        try:
            fd = os.open(_path(self.name), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            raise ShmUnavailable(f"cannot create {_path(self.name)}: {e}") from None
        try:
            os.posix_fallocate(fd, 0, PAGE + size)  # ENOSPC here, not SIGBUS on a later write into a full tmpfs
            self._mm = mmap.mmap(fd, PAGE + size)
        except OSError as e:
            _unlink(self.name)
            raise ShmUnavailable(f"cannot allocate a {size}-byte ring in {SHM_DIR}: {e}") from None
        finally:
            os.close(fd)
        _HEAD.pack_into(self._mm, 0, MAGIC, self.token, size)
        _U64.pack_into(self._mm, TAIL_AT, 0)
        _populate(self._mm, _MADV_POPULATE_READ)
        self._data = memoryview(self._mm)[PAGE:]

    def announce(self) -> list[Any]:
        """What the welcome tells the sender: name, data size, token."""
        return [self.name, self.size, self.token]

    def views(self, where: Any, sizes: Sequence[int]) -> tuple[list[memoryview], int]:
        """Read-only views of a piece's frames (checked by check_positions) and the position to release after it."""
        if self._closed:
            raise ProtocolError("shared-memory ring already closed")
        offsets = check_positions(where, sizes, self.tail, self.size)
        return [self._data[o : o + n].toreadonly() for o, n in zip(offsets, sizes)], where[-1]

    def release(self, end: Any) -> None:
        """Everything before `end` is consumed: the sender may overwrite it. Ignores ends behind the tail or more than a
        lap ahead of it (a refused piece whose header lied: the sender's send timeout covers a ring that then stalls)."""
        if self._closed or not isinstance(end, int) or isinstance(end, bool) or not 0 <= end - self.tail <= self.size:
            return
        self.tail = end
        _fence()
        _U64.pack_into(self._mm, TAIL_AT, end)

    def close(self) -> None:
        """Unlink the name (if the sender has not already) and unmap; a view a careless sink kept alive keeps the
        mapping until it is collected, never the name."""
        if self._closed:
            return
        self._closed = True
        _unlink(self.name)
        try:
            self._data.release()
            self._mm.close()
        except BufferError:
            log.debug("shared-memory ring %s still viewed: unmapped when the views are collected", self.name)


class RingWriter:
    """Sender side: the mapped ring of one receiver session, written at `head`, bounded by the receiver's tail."""

    def __init__(self, name: str, size: int, token: bytes) -> None:
        self.name, self.size, self.head = name, size, 0
        path = _path(name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as e:
            raise ShmUnavailable(f"cannot open {path} (not on the receiver's node?): {e}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size != PAGE + size:
                raise ShmUnavailable(f"{path} is not the receiver's ring (type, owner or size differ)")
            mm = mmap.mmap(fd, PAGE + size)
        except OSError as e:
            raise ShmUnavailable(f"cannot map {path}: {e}") from None
        finally:
            os.close(fd)
        magic, got, data_size = _HEAD.unpack_from(mm, 0)
        if magic != MAGIC or got != token or data_size != size:
            mm.close()
            raise ShmUnavailable(f"{path} is not the ring the receiver announced (token differs)")
        _unlink(name)  # both ends have it mapped: from here on no crash can leave it behind
        _populate(mm, _MADV_POPULATE_WRITE)
        self._mm = mm
        self._data: np.ndarray | None = np.frombuffer(mm, dtype=np.uint8)[PAGE:]

    @classmethod
    def open(cls, announced: Any) -> RingWriter:
        """Map the ring a (MACed) welcome announced: [name, size, token], each checked before the file is opened."""
        if not (
            isinstance(announced, list)
            and len(announced) == 3
            and isinstance(announced[0], str)
            and NAME_RE.match(announced[0])
            and isinstance(announced[1], int)
            and MIN_RING_BYTES <= announced[1] <= MAX_RING_BYTES
            and isinstance(announced[2], bytes)
            and len(announced[2]) == 16
        ):
            raise ShmUnavailable(f"malformed ring announcement {announced!r:.100}")
        return cls(*announced)

    def fits(self, sizes: Sequence[int]) -> bool:
        """Whether a piece of these frames can ever fit (an empty ring); larger pieces go inline."""
        return place(0, sizes, self.size)[-1] <= self.size

    def reserve(self, sizes: Sequence[int]) -> list[int] | None:
        """Positions for the frames (then their end), or None while the receiver has not freed enough room."""
        where = place(self.head, sizes, self.size)
        return where if self.has_room(where[-1]) else None

    def end_of(self, sizes: Sequence[int]) -> int:
        """Where frames of these sizes written now would end (what has_room is asked about while the ring is full)."""
        return place(self.head, sizes, self.size)[-1]

    def has_room(self, end: int) -> bool:
        """Whether the receiver has released enough for a region ending at `end` (reads only its tail); a closed ring
        (its peer dropped meanwhile) answers yes, so that nobody waits on it."""
        if self._data is None:
            return True
        return end - min(_U64.unpack_from(self._mm, TAIL_AT)[0], self.head) <= self.size

    def write(self, pos: int, t: torch.Tensor) -> np.ndarray:
        """One frame's bytes into the ring: a single-threaded memcpy that releases the GIL (numpy), because torch's
        parallel copy stalls on a busy machine waiting for a worker thread that is not scheduled (measured: 2 MiB
        copies at 0.2 GB/s on this 2-core box under load). Returns the copy (a view of the ring)."""
        assert self._data is not None
        off = pos % self.size
        flat = t.reshape(-1).view(torch.uint8).numpy()
        copy = self._data[off : off + flat.size]
        np.copyto(copy, flat)
        return copy

    def commit(self, end: int) -> None:
        """The frames up to `end` are written and their header sent."""
        self.head = end

    def close(self) -> None:
        self._data = None
        try:
            self._mm.close()
        except BufferError:
            log.debug("shared-memory ring %s still viewed at close", self.name)


def sweep_stale(now: float | None = None) -> int:
    """Unlink ring names of receivers that died before their sender mapped them (pid gone, ours, old enough)."""
    now = time.time() if now is None else now
    gone = 0
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    for name in names:
        if not NAME_RE.match(name):
            continue
        pid = int(name[len(PREFIX) :].split("-", 1)[0])
        try:
            if not left_behind(pid, os.stat(_path(name), follow_symlinks=False), now):
                continue
        except OSError:
            continue
        _unlink(name)
        gone += 1
    return gone


def left_behind(pid: int, info: os.stat_result, now: float) -> bool:
    """A file of this user named for process ``pid``, which is gone, and at least ``STALE_AGE_S`` old (another PID
    namespace may share the folder): what a killed receiver left (a ring's name, a KV cache socket)."""
    if pid <= 0 or info.st_uid != os.getuid() or now - info.st_mtime < STALE_AGE_S:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False  # alive
