"""The decode worker's KV cache in shared memory, written in place by same-node senders (the `shm-direct` and
`cuda-ipc` paths; docs/transfer.md, "Same-node direct writes").

The cache is two memfds (gone with the last process that maps them), handed to a sender that proves the token of the
MACed welcome over a Unix socket (transfer/fd_pass.py; a worker's /proc/<pid>/fd is closed to other processes). The
control memfd: page 0: magic | token | num_layers | num_blocks | layer_bytes, then one u64 owner tag per block (0:
free; else `tag_of` the transfer expected into it). It is sealed against writes once the receiver mapped it
(F_SEAL_FUTURE_WRITE), so a sender can map it only read-only: no sender can tag blocks for itself. The data memfd: per
layer ``[2, num_blocks, block_size, kv_heads, head_dim]`` (K, V). A writer writes a block only while its tag is its
transfer's, holding the flock of its own file description of the control memfd over the check and the copies; the
receiver clears a failed transfer's tags under the flock, so afterwards no write into them is under way. A sender
still maps the data writable: the tags keep an honest sender's late or wrong writes out of other transfers' blocks,
not a hostile process of the cluster's user (docs/architecture.md, "What a node trusts"). On a GPU the layers stay the
engine's CUDA tensors (announced as CUDA IPC handles, transfer/cuda_ipc.py) and a writer waits for its copies before
unlocking.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import math
import mmap
import os
import secrets
import stat
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from transfer import cuda_ipc
from transfer.errors import ChecksumError, ProtocolError
from transfer.fd_pass import FdPassError, FdServer, check_path, fetch_fds
from transfer.shm_ring import PAGE, ShmUnavailable
from transfer.wire import FrameSpec, ModelFingerprint, frame_bytes

log = logging.getLogger(__name__)

MAGIC = b"PDSVKVC1"
_HEAD = struct.Struct("<8s16sQQQ")  # magic, token, num_layers, num_blocks, layer_bytes
TOUCH_CHUNK_BYTES = 64 << 20  # pages mapped per look at whether the writer closed meanwhile
LOCK_POLL_S = 1e-4  # naps while the other side holds the flock (one piece's copy, under a millisecond)
WRITE_LOCK_WAIT_S = 1.0  # a writer waits this long for the flock, then fails the piece's transfer
DEVICE_COPY_WAIT_S = 5.0  # a GPU writer's copy of one piece, at most (then the piece's transfer fails)
F_SEAL_FUTURE_WRITE = 0x10  # Linux >= 5.1: no new writable mapping or write(); the receiver's own mapping stays
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL


def tag_of(transfer_id: str) -> int:
    """A transfer's owner tag: never 0, which marks a block nobody is receiving into."""
    return xxhash.xxh3_64_intdigest(transfer_id.encode()) or 1


def pid_namespace() -> str:
    """Which processes' /proc/<pid> this process sees: the segment is offered only to a sender in the same one."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _layout(fp: ModelFingerprint, num_blocks: int, host_layers: bool = True) -> tuple[int, int, int]:
    """(bytes of the control memfd, bytes per layer, bytes of the data memfd) of a segment for `fp` with `num_blocks`
    blocks (without ``host_layers``: no data memfd, 0)."""
    block_bytes = math.prod(fp.block_shape) * fp.torch_dtype.itemsize
    layer_bytes = 2 * num_blocks * block_bytes
    control = -(-(PAGE + 8 * num_blocks) // PAGE) * PAGE
    return control, layer_bytes, fp.num_layers * layer_bytes * host_layers


def _memfd(name: str, nbytes: int, sealing: bool = False) -> int:
    flags = os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if sealing else 0)
    try:
        fd = os.memfd_create(f"pdserve-{name}-{os.getpid()}", flags)
    except (AttributeError, OSError) as e:
        raise ShmUnavailable(f"no memfd for a shared KV cache: {e}") from None
    try:
        os.fchmod(fd, 0o600)
        os.posix_fallocate(fd, 0, nbytes)  # ENOSPC now, not SIGBUS on a later write
    except OSError as e:
        os.close(fd)
        raise ShmUnavailable(f"cannot allocate a {nbytes}-byte shared KV cache: {e}") from None
    return fd


def _reopen(fd: int, flags: int) -> int:
    """A new file description of one of our own memfds (a sender's flock must not be the receiver's; a dup shares
    it), read-only or not."""
    return os.open(f"/proc/self/fd/{fd}", flags | os.O_CLOEXEC)


@functools.lru_cache(maxsize=64)
def runs_of(blocks: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    """(first source row, first block, count) of each run of consecutive block ids: one copy or view per run. Cached:
    every layer of a chunk names the same blocks."""
    out = []
    start = 0
    for i in range(1, len(blocks) + 1):
        if i == len(blocks) or blocks[i] != blocks[i - 1] + 1:
            out.append((start, blocks[start], i - start))
            start = i
    return tuple(out)


def _touch(data: np.ndarray, stop: threading.Event) -> None:
    """Read one byte of every page, a chunk at a time (numpy's reduction runs without the GIL): a read maps a shared
    page writable, so later copies into it fault no more."""
    for start in range(0, data.size, TOUCH_CHUNK_BYTES):
        if stop.is_set():
            return
        int(data[start : start + TOUCH_CHUNK_BYTES : PAGE].sum())


class _Mapped:
    """A mapped segment's views: control page, owner tags (read-only in a sender), and each layer's K/V as a tensor
    and (host layers) as bytes. ``device_layers``: the layers are CUDA tensors, no data memfd. ``fd``: this side's
    own file description of the control memfd, whose flock the writers and the receiver take."""

    def __init__(
        self,
        control: mmap.mmap,
        fd: int,
        data: tuple[mmap.mmap, int] | None,
        fp: ModelFingerprint,
        num_blocks: int,
        device_layers: list[torch.Tensor] | None = None,
    ) -> None:
        _, layer_bytes, _ = _layout(fp, num_blocks)
        self.mm, self.fd, self.data, self.fp, self.num_blocks = control, fd, data, fp, num_blocks
        self.tags = np.frombuffer(control, dtype=np.uint64, count=num_blocks, offset=PAGE)
        self.block_bytes = layer_bytes // (2 * num_blocks)
        self.on_device = device_layers is not None
        shape = (2, num_blocks, *fp.block_shape)
        if device_layers is not None:
            self.bytes = np.empty(0, dtype=np.uint8)
            self.layers = [t.view(fp.torch_dtype).view(shape) for t in device_layers]
            return
        assert data is not None
        self.bytes = np.frombuffer(data[0], dtype=np.uint8, count=fp.num_layers * layer_bytes)
        whole = torch.from_numpy(self.bytes)  # through numpy: its buffer export keeps mm from closing under a view
        self.layers = [
            whole[i * layer_bytes : (i + 1) * layer_bytes].view(fp.torch_dtype).view(shape)
            for i in range(fp.num_layers)
        ]

    def block_bytes_of(self, layer: int, half: int, first: int, count: int) -> np.ndarray:
        """The bytes of `count` blocks from `first`, of K (half 0) or V (half 1) of one layer."""
        start = ((2 * layer + half) * self.num_blocks + first) * self.block_bytes
        return self.bytes[start : start + count * self.block_bytes]

    def lock(self, wait_s: float) -> bool:
        """The segment's flock, waited for at most ``wait_s`` (its holder copies one piece, or clears tags)."""
        end = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() >= end:
                    return False
                time.sleep(LOCK_POLL_S)

    def unlock(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        del self.tags, self.bytes
        self.layers = []
        for mm, fd in [(self.mm, self.fd)] + ([self.data] if self.data is not None else []):
            with contextlib.suppress(OSError):
                os.close(fd)
            try:
                mm.close()
            except BufferError:  # the engine's cache tensors still view it: unmapped when they are collected
                log.debug("KV segment still viewed at close")


class KVSegment:
    """Receiver side: the cache's memory, the owner tags of the transfers it expects, and the checks of pieces that
    landed in place. The engine's cache tensors are ``layers`` (``KVCache.rehome``); on a GPU they are the engine's
    own, passed as ``device_layers`` with the UUID of their ``gpu``."""

    def __init__(
        self,
        fp: ModelFingerprint,
        num_blocks: int,
        device_layers: list[torch.Tensor] | None = None,
        gpu: str | None = None,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be > 0")
        self.fp = fp
        self.token = secrets.token_bytes(16)
        self.gpu = gpu
        self._exports: list[list[Any]] = []
        if device_layers is not None:
            if gpu is None:
                raise ValueError("a segment of device layers needs its GPU's UUID")
            try:
                self._exports = [cuda_ipc.export(t) for t in device_layers]
            except cuda_ipc.CudaIpcError as e:
                raise ShmUnavailable(f"the KV cache has no CUDA IPC handles: {e}") from None
        control_bytes, layer_bytes, data_bytes = _layout(fp, num_blocks, host_layers=device_layers is None)
        opened: list[int] = []
        try:
            opened.append(_memfd("kvtags", control_bytes, sealing=True))
            control = mmap.mmap(opened[0], control_bytes)
            _HEAD.pack_into(control, 0, MAGIC, self.token, fp.num_layers, num_blocks, layer_bytes)
            try:  # after our mapping: it stays writable, every later one (a sender's) is read-only
                fcntl.fcntl(opened[0], fcntl.F_ADD_SEALS, SEALS)
            except OSError as e:
                control.close()
                raise ShmUnavailable(f"the KV cache's owner tags cannot be sealed (Linux < 5.1?): {e}") from None
            data = None
            if device_layers is None:
                opened.append(_memfd("kvc", data_bytes))
                data = (mmap.mmap(opened[1], data_bytes), opened[1])
        except (OSError, ShmUnavailable) as e:
            for fd in opened:
                os.close(fd)
            raise e if isinstance(e, ShmUnavailable) else ShmUnavailable(f"cannot map a shared KV cache: {e}") from None
        self.nbytes, self.num_blocks, self.on_device = control_bytes + data_bytes, num_blocks, device_layers is not None
        self._map = _Mapped(control, opened[0], data, fp, num_blocks, device_layers)
        self._claims: dict[str, np.ndarray] = {}  # transfer id -> its destination blocks, tagged
        self._closed = False
        try:
            self._server = FdServer(self.token, self._fds_for_sender)
        except OSError as e:
            self._map.close()
            raise ShmUnavailable(f"no socket to hand the KV cache to senders: {e}") from None

    def _fds_for_sender(self) -> list[int]:
        """A sender's own file descriptions: the control memfd read-only (sealed: it could not map it writable
        anyway), the data memfd read-write."""
        fds = [_reopen(self._map.fd, os.O_RDONLY)]
        if self._map.data is not None:
            fds.append(_reopen(self._map.data[1], os.O_RDWR))
        return fds

    @property
    def handoffs_refused(self) -> int:
        """Processes that asked for the cache without proving its token (or of another user)."""
        return self._server.refused

    @property
    def layers(self) -> list[torch.Tensor]:
        """Per layer ``[2, num_blocks, block_size, kv_heads, head_dim]``: the engine's cache, in this segment."""
        return self._map.layers

    def announce(self) -> list[Any]:
        """What the welcome tells a same-node sender: [socket path, token, num_blocks], and on a GPU
        [gpu UUID, [[handle, offset, nbytes] per layer]]."""
        head = [self._server.path, self.token, self.num_blocks]
        return [*head, [self.gpu, self._exports]] if self.on_device else head

    def claim(self, transfer_id: str, blocks: Sequence[int], wait_s: float = 1.0) -> None:
        """Let `transfer_id`'s sender write `blocks` (at expect). A block may still carry the tag of a transfer that
        ended and is not released yet (a failed pre-copy before its tail): retagged under the flock, so that
        transfer's writer finishes first and is refused from then on."""
        if self._closed:
            return
        index = np.asarray(blocks, dtype=np.int64)
        if index.min() < 0 or index.max() >= self.num_blocks:
            raise ValueError(f"blocks outside the shared cache's {self.num_blocks}")

        def tag() -> None:
            self._map.tags[index] = tag_of(transfer_id)

        if not self._map.tags[index].any():
            tag()
        elif not self._locked(tag, wait_s):
            raise TimeoutError(f"a KV writer held the shared cache for {wait_s}s")
        self._claims[transfer_id] = index

    def release(self, transfer_id: str, writer_may_run: bool, wait_s: float = 1.0) -> bool:
        """Clear a transfer's tags (those it still holds). ``writer_may_run`` (it failed): under the flock, so that
        on True no write into its blocks is under way or can start; False if a writer held the flock for all of
        ``wait_s`` (stopped mid-copy?): the caller tries again later and frees nothing meanwhile."""
        index = self._claims.get(transfer_id)
        if index is None or self._closed:
            return True
        tag = tag_of(transfer_id)

        def clear() -> None:
            mine = index[self._map.tags[index] == tag]
            self._map.tags[mine] = 0

        if writer_may_run:
            if not self._locked(clear, wait_s):
                return False
        else:
            clear()
        del self._claims[transfer_id]
        return True

    def _locked(self, change: Callable[[], None], wait_s: float) -> bool:
        if not self._map.lock(wait_s):
            return False
        try:
            change()
        finally:
            self._map.unlock()
        return True

    def verify(self, layer: int, blocks: Sequence[int], frames: Sequence[FrameSpec]) -> None:
        """Check a piece that landed in place: each frame's xxh3 (K, then V) over its destination blocks in order."""
        runs = runs_of(tuple(blocks))
        for half, spec in enumerate(frames):
            if spec.xxh3 is None:
                continue
            if self.on_device:  # as over NCCL: no hash of device memory
                raise ProtocolError("a checksum over a GPU cache's blocks")
            h = xxhash.xxh3_64()
            for _, first, count in runs:
                h.update(self._map.block_bytes_of(layer, half, first, count).data)
            if h.intdigest() != spec.xxh3:
                raise ChecksumError(f"xxh3 mismatch over the destination blocks of layer {layer}")

    def close(self) -> None:
        """Refuse every writer from now on (a GPU cache's memory goes back to its allocator), then unmap."""
        self._closed = True
        self._server.close()
        self._locked(lambda: self._map.tags.fill(0), WRITE_LOCK_WAIT_S)
        self._map.close()


@dataclass(frozen=True, slots=True)
class DirectPiece:
    """One layer's K and V of a transfer, for its destination blocks; ``ready``: the CUDA event after which device
    sources hold their KV."""

    transfer_id: str
    layer: int
    blocks: Sequence[int]
    k: torch.Tensor
    v: torch.Tensor
    ready: Any = None


class SegmentWriter:
    """Sender side: a receiver's mapped KV cache, written only into blocks tagged for the piece's transfer."""

    def __init__(
        self, fp: ModelFingerprint, path: str, token: bytes, num_blocks: int, device: list[Any] | None = None
    ) -> None:
        control_bytes, layer_bytes, data_bytes = _layout(fp, num_blocks, host_layers=device is None)
        try:
            fds = fetch_fds(path, token, 1 if device is not None else 2)
        except FdPassError as e:
            raise ShmUnavailable(str(e)) from None
        maps: list[mmap.mmap] = []
        try:
            for fd, size in zip(fds, (control_bytes, data_bytes), strict=False):
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size != size:
                    raise ShmUnavailable(f"{path} handed over no KV cache of this model (type, owner or size differ)")
            maps.append(mmap.mmap(fds[0], control_bytes, prot=mmap.PROT_READ))  # sealed: read-only is all it allows
            if device is None:
                maps.append(mmap.mmap(fds[1], data_bytes))
        except (OSError, ShmUnavailable) as e:
            for m in maps:
                m.close()
            for fd in fds:
                os.close(fd)
            raise e if isinstance(e, ShmUnavailable) else ShmUnavailable(f"cannot map {path}'s KV cache: {e}") from None
        magic, got, layers, blocks, _ = _HEAD.unpack_from(maps[0], 0)
        self._opened: cuda_ipc.OpenedMemory | None = None
        self._stream: Any = None
        try:
            if magic != MAGIC or got != token or layers != fp.num_layers or blocks != num_blocks:
                raise ShmUnavailable(f"{path} handed over another KV cache than announced (token or layout differ)")
            device_layers = None if device is None else self._open_device(device, fp.num_layers, layer_bytes)
        except (ShmUnavailable, cuda_ipc.CudaIpcError, RuntimeError, TypeError, ValueError) as e:
            self._close_device()
            for m in maps:
                m.close()
            for fd in fds:
                os.close(fd)
            raise e if isinstance(e, ShmUnavailable) else ShmUnavailable(f"cannot open the GPU KV cache: {e}") from None
        data = (maps[1], fds[1]) if device is None else None
        self._map = _Mapped(maps[0], fds[0], data, fp, num_blocks, device_layers)
        self.on_device = self._map.on_device
        self._last: tuple[tuple[str, tuple[int, ...]], np.ndarray, tuple[tuple[int, int, int], ...]] | None = None
        # every page mapped into this process once, off the I/O thread: a first write into a page costs a fault, and
        # each new request's blocks are new pages (measured: 45 MiB into fresh pages 27 ms, into mapped ones 6.6 ms)
        self._stop = threading.Event()
        self._toucher = threading.Thread(target=_touch, args=(self._map.bytes, self._stop), name="kv-map", daemon=True)
        self._toucher.start()

    def _open_device(self, device: list[Any], num_layers: int, layer_bytes: int) -> list[torch.Tensor]:
        """Each layer's bytes through its CUDA IPC handle, on this process's index of the receiver's GPU."""
        if not (isinstance(device, list) and len(device) == 2):
            raise cuda_ipc.CudaIpcError("malformed GPU cache announcement")
        gpu, exports = device
        if not isinstance(gpu, str) or not isinstance(exports, list) or len(exports) != num_layers:
            raise cuda_ipc.CudaIpcError("malformed GPU cache announcement")
        self._opened = cuda_ipc.OpenedMemory(gpu)
        layers = []
        for exported in exports:
            if not (isinstance(exported, list) and len(exported) == 3 and exported[2] == layer_bytes):
                raise cuda_ipc.CudaIpcError(f"a GPU cache layer is not {layer_bytes} bytes")
            layers.append(self._opened.tensor(exported))
        if layers and layers[0].is_cuda:
            self._stream = torch.cuda.Stream(layers[0].device)  # the copies' own: the engine's stream never waits
        return layers

    def _close_device(self) -> None:
        if self._opened is not None:
            self._opened.close()
            self._opened = None

    @classmethod
    def open(cls, fp: ModelFingerprint, announced: Any) -> SegmentWriter:
        """Map what a (MACed) welcome announced: [socket path, token, num_blocks] (and a GPU cache's [gpu, handles]),
        each checked before connecting."""
        if not (
            isinstance(announced, list)
            and len(announced) in (3, 4)
            and isinstance(announced[2], int)
            and not isinstance(announced[2], bool)
            and 0 < announced[2] < 1 << 31
            and isinstance(announced[1], bytes)
            and len(announced[1]) == 16
        ):
            raise ShmUnavailable(f"malformed KV cache announcement {announced!r:.100}")
        try:
            path = check_path(announced[0])
        except FdPassError as e:
            raise ShmUnavailable(f"malformed KV cache announcement: {e}") from None
        return cls(fp, path, announced[1], announced[2], announced[3] if len(announced) == 4 else None)

    def write_all(self, pieces: Sequence[DirectPiece], digest: bool) -> list[list[int] | None | ProtocolError]:
        """Copy each piece's K and V into its blocks, under one hold of the flock from the checks to the end of the
        copies; a piece whose blocks are not all tagged for its transfer gets a ProtocolError, nothing of it written.
        With `digest` (host caches): per piece, the xxh3 of K's and of V's destination blocks in order, each run
        hashed right after its copy, while it is still in cache."""
        results: list[list[int] | None | ProtocolError] = [None] * len(pieces)
        plans: dict[int, tuple[np.ndarray, tuple[tuple[int, int, int], ...]]] = {}
        for i, piece in enumerate(pieces):
            try:
                plans[i] = self._plan(piece.transfer_id, piece.blocks)
            except ProtocolError as e:
                results[i] = e
        if not plans:
            return results
        if not self._map.lock(WRITE_LOCK_WAIT_S):  # the receiver holds it only to clear tags: stopped or gone?
            error = ProtocolError(f"the receiver's KV cache stayed locked for {WRITE_LOCK_WAIT_S}s")
            return [error if i in plans else r for i, r in enumerate(results)]
        try:
            # each transfer's blocks are checked once a batch: its layers' pieces name the same blocks
            owned: dict[tuple[str, int], bool] = {}
            for i, (index, _) in list(plans.items()):
                piece = pieces[i]
                key = (piece.transfer_id, id(index))
                if key not in owned:
                    owned[key] = bool((self._map.tags[index] == tag_of(piece.transfer_id)).all())
                if not owned[key]:
                    blocks = list(piece.blocks)[:8]
                    results[i] = ProtocolError(
                        f"blocks {blocks} are not reserved for transfer {piece.transfer_id!r} now"
                    )
                    del plans[i]
            try:
                if self._map.on_device:
                    self._copy_on_device([(pieces[i], runs) for i, (_, runs) in plans.items()])
                    return results
            except ProtocolError as e:  # a copy that never ended: every piece of the batch fails
                return [e if i in plans else r for i, r in enumerate(results)]
            # numpy's memcpy, one thread without the GIL: two threads, or torch's parallel copy (called from the
            # sender's I/O thread, not a main thread), measured no faster end to end on 2 cores
            for i, (_, runs) in plans.items():
                digests = [self._copy_frame(pieces[i], half, runs, digest) for half in (0, 1)]
                if digest:
                    results[i] = [d for d in digests if d is not None]
            return results
        finally:
            self._map.unlock()

    def _copy_frame(
        self, piece: DirectPiece, half: int, runs: tuple[tuple[int, int, int], ...], digest: bool
    ) -> int | None:
        """K (half 0) or V of one piece into its runs of blocks; the xxh3 of the destination bytes if `digest`."""
        size = self._map.block_bytes
        src = frame_bytes(piece.v if half else piece.k)
        h = xxhash.xxh3_64() if digest else None
        for row, first, count in runs:
            dst = self._map.block_bytes_of(piece.layer, half, first, count)
            np.copyto(dst, src[row * size : (row + count) * size])
            if h is not None:
                h.update(dst.data)
        return None if h is None else h.intdigest()

    def _copy_on_device(self, planned: list[tuple[DirectPiece, tuple[tuple[int, int, int], ...]]]) -> None:
        """Device to device on the writer's stream, each piece after its ``ready`` event; waited for (bounded) before
        the flock goes, so that a cleared tag means no copy is in flight."""
        stream = self._stream
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for piece, runs in planned:
                dst = self._map.layers[piece.layer]
                if piece.ready is not None and stream is not None:
                    stream.wait_event(piece.ready)
                for half, src in enumerate((piece.k, piece.v)):
                    for row, first, count in runs:
                        dst[half, first : first + count].copy_(src[row : row + count], non_blocking=True)
            if stream is None:
                return
            done = torch.cuda.Event()
            done.record(stream)
        end = time.monotonic() + DEVICE_COPY_WAIT_S
        while not done.query():
            if time.monotonic() >= end:
                raise ProtocolError(f"a KV copy into the receiver's GPU cache took over {DEVICE_COPY_WAIT_S}s")
            time.sleep(LOCK_POLL_S)

    def _plan(self, transfer_id: str, blocks: Sequence[int]) -> tuple[np.ndarray, tuple[tuple[int, int, int], ...]]:
        """The checked block index and its runs, kept for the next piece (every layer of a chunk has the same)."""
        key = (transfer_id, tuple(blocks))
        if self._last is not None and self._last[0] == key:
            return self._last[1], self._last[2]
        index = np.asarray(blocks, dtype=np.int64)
        if index.min() < 0 or index.max() >= self._map.num_blocks or len(set(blocks)) != len(blocks):
            raise ProtocolError(f"destination blocks outside the receiver's cache or repeated: {list(blocks)[:8]}")
        runs = runs_of(key[1])
        self._last = (key, index, runs)
        return index, runs

    def close(self) -> None:
        self._stop.set()
        self._toucher.join(timeout=1.0)
        self._map.layers = []  # the tensors over opened GPU memory go before it is closed
        self._close_device()
        self._map.close()
