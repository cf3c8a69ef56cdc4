"""The direct path of `shm`/`auto`: a same-node sender writes KV into the receiver's cache, which lives in shared memory.

Round trips are bit-exact into scattered blocks and never call the sink; the receiver checks each piece's xxh3 over its
own destination blocks; a sender may write only blocks tagged for its transfer (a refused write changes nothing); a
transfer failed by the receiver stops its sender's writes before its blocks are given back; a killed sender's transfer
fails and nothing is left in /dev/shm; pieces ready together leave as one batch; what cannot go direct (an int8 wire,
a sender that does not allow it) goes inline or through a ring.
"""

from __future__ import annotations

import mmap
import os
import resource
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.helpers import transfer_peers as procs
from tests.helpers.kv import bits, fingerprint, make_kv, poll_until, write_piece
from transfer.config import TransferConfig
from transfer.errors import ChecksumError, PeerGone, ProtocolError
from transfer.kv_segment import DirectPiece, KVSegment, SegmentWriter, tag_of
from transfer.path import Peer
from transfer.receiver import Receiver
from transfer.sender import Sender
from transfer.shm_ring import PREFIX, SHM_DIR, ShmUnavailable
from transfer.state import TransferState

pytestmark = pytest.mark.timeout(60)
SECRET = "direct-secret-0123456789abcdef"


def _cfg(**kw) -> TransferConfig:
    return TransferConfig(**{"deadline_s": 5.0, "lease_s": 1.5, "secret": SECRET, **kw})


class SegmentCache:
    """The decode side: the cache is the segment's; the sink (inline pieces only) writes it and counts."""

    def __init__(self, fp, num_blocks: int = 40) -> None:
        self.fp, self.segment, self.writes = fp, KVSegment(fp, num_blocks), 0

    def sink(self, tid, layer, blocks, k, v) -> None:
        index = torch.tensor(blocks)
        self.segment.layers[layer][0][index] = k
        self.segment.layers[layer][1][index] = v
        self.writes += 1

    def holds(self, dst, seed) -> bool:
        index = torch.tensor(dst)
        for layer in range(self.fp.num_layers):
            k, v = make_kv(self.fp, layer, len(dst), seed)
            kv = self.segment.layers[layer]
            if not (torch.equal(bits(kv[0][index]), bits(k)) and torch.equal(bits(kv[1][index]), bits(v))):
                return False
        return True

    def tagged(self) -> int:
        return int(self.segment._map.tags.astype(bool).sum())


def _pair(closing, dtype="bfloat16", rcfg=None, scfg=None):
    fp = fingerprint(dtype)
    cache = SegmentCache(fp)
    r = closing(Receiver(fp, cache.sink, "shm+tcp://127.0.0.1:0", rcfg or _cfg(), "shm", segment=cache.segment))
    s = closing(Sender(fp, scfg or _cfg(), "shm"))
    return fp, cache, r, s


def _send(s, fp, tid, dst, seed, finish=True):
    for layer in range(fp.num_layers):
        k, v = make_kv(fp, layer, len(dst), seed)
        s.send_layer(tid, layer, dst, k, v)
    if finish:
        s.finish(tid)


def _both(r, s, timeout=10.0):
    rev, sev = [], []
    poll_until(
        [lambda: rev.extend(r.poll()) or [], lambda: sev.extend(s.poll()) or []],
        lambda _: bool(rev) and bool(sev),
        timeout,
    )
    return rev, sev


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bit_exact_into_scattered_blocks_without_the_sink(dtype, closing) -> None:
    fp, cache, r, s = _pair(closing, dtype)
    for i, dst in enumerate(([3], [7, 8, 9, 20, 2, 31], list(range(10, 22)))):
        r.expect(f"t{i}", dst)
        s.begin(f"t{i}", r.address)
        _send(s, fp, f"t{i}", dst, seed=i)
        rev, sev = _both(r, s)
        assert [e.state for e in rev + sev] == [TransferState.DONE] * 2, rev + sev
        assert cache.holds(dst, seed=i)
    assert cache.writes == 0 and r.direct_pieces == s.direct_pieces == 3 * fp.num_layers
    assert set(s.paths().values()) == {"shm-direct"}
    assert cache.tagged() == 0 and r.pending_transfers() == [] and s.active_transfers() == []


def test_pieces_ready_together_leave_as_one_message(closing, monkeypatch) -> None:
    fp, cache, r, s = _pair(closing)
    sent = []
    monkeypatch.setattr(Peer, "seal", lambda self, h, f=Peer.seal: sent.append(h.kind) or f(self, h))
    r.expect("t", [1, 2])
    s.begin("t", r.address)
    _send(s, fp, "t", [1, 2], seed=5)  # all queued before the handshake: the receiver answers it only when polled
    rev, sev = _both(r, s)
    assert [e.state for e in rev + sev] == [TransferState.DONE] * 2
    assert cache.holds([1, 2], seed=5)
    assert sent.count("kvs") >= 1 and sent.count("kvs") + sent.count("kv") < fp.num_layers, sent


def test_a_checksum_mismatch_over_the_destination_fails_the_transfer(closing, monkeypatch) -> None:
    fp, cache, r, s = _pair(closing)
    real = SegmentWriter.write_all

    def write_then_flip(self, pieces, digest):
        digests = real(self, pieces, digest)
        for piece in pieces:
            if piece.layer == 2:  # the blocks change after the sender's hash
                self._map.layers[piece.layer][1][piece.blocks[0]].view(-1)[0] += 1
        return digests

    monkeypatch.setattr(SegmentWriter, "write_all", write_then_flip)
    r.expect("t", [4, 5])
    s.begin("t", r.address)
    _send(s, fp, "t", [4, 5], seed=1)
    rev, sev = _both(r, s)
    assert rev[0].state == TransferState.FAILED and isinstance(rev[0].error, ChecksumError)
    assert sev[0].state == TransferState.FAILED and cache.tagged() == 0


def test_a_sender_writes_only_blocks_tagged_for_its_transfer(closing) -> None:
    fp, cache, r, s = _pair(closing)
    r.expect("t", [1, 2])
    s.begin("t", r.address)
    _send(s, fp, "t", [1, 3], seed=1)  # block 3 is nobody's
    rev, sev = _both(r, s)
    assert sev[0].state == TransferState.FAILED and isinstance(sev[0].error, ProtocolError)
    assert rev[0].state == TransferState.FAILED
    assert all(not kv.any() for kv in cache.segment.layers)  # nothing written: block 1 is checked with block 3
    writer = SegmentWriter.open(fp, cache.segment.announce())
    try:
        k, v = make_kv(fp, 0, 1, seed=0)
        with pytest.raises(ProtocolError, match="outside"):
            write_piece(writer, "t", 0, [cache.segment.num_blocks], k, v, True)
    finally:
        writer.close()


def test_in_a_batch_only_the_pieces_whose_blocks_are_not_theirs_are_refused() -> None:
    fp = fingerprint("float32")
    segment = KVSegment(fp, 16)
    writer = SegmentWriter.open(fp, segment.announce())
    try:
        segment.claim("a", [1, 2])
        segment.claim("b", [5])
        pieces = [
            DirectPiece("a", 0, [1, 2], *make_kv(fp, 0, 2, seed=1)),
            DirectPiece("b", 0, [6], *make_kv(fp, 0, 1, seed=2)),  # block 6 is nobody's
            DirectPiece("b", 1, [5], *make_kv(fp, 1, 1, seed=2)),
            DirectPiece("a", 1, [1, 99], *make_kv(fp, 1, 2, seed=1)),  # outside the cache
        ]
        results = writer.write_all(pieces, digest=True)
        assert [type(r).__name__ for r in results] == ["list", "ProtocolError", "list", "ProtocolError"]
        assert all(len(r) == 2 for r in results if isinstance(r, list))  # K's and V's xxh3
        k, v = make_kv(fp, 0, 2, seed=1)
        assert torch.equal(bits(segment.layers[0][0][1:3]), bits(k)) and torch.equal(
            bits(segment.layers[0][1][1:3]), bits(v)
        )
        assert not segment.layers[0][:, 6].any() and not segment.layers[1][:, 1].any()
    finally:
        writer.close()
        segment.close()


def test_a_transfer_failed_by_the_receiver_stops_its_sender_before_its_blocks_go_back(closing) -> None:
    fp, cache, r, s = _pair(closing)
    r.expect("t", [6, 7])
    writer = SegmentWriter.open(fp, cache.segment.announce())
    try:
        k, v = make_kv(fp, 0, 2, seed=3)
        write_piece(writer, "t", 0, [6, 7], k, v, True)  # allowed while the transfer runs
        assert writer._map.lock(1.0)  # a write under way ...
        t0 = time.monotonic()
        r.abort("t")  # ... is waited for (bounded), then the tags are cleared
        assert time.monotonic() - t0 >= 0.9 and cache.tagged() == 2  # the writer kept the flock: nothing released
        events = r.poll()
        assert events == []  # the failure is held while a writer may still be copying into its blocks
        writer._map.unlock()
        events = poll_until([r.poll], lambda e: e, 5)
        assert events[0].state == TransferState.FAILED and cache.tagged() == 0
        with pytest.raises(ProtocolError, match="not reserved"):
            write_piece(writer, "t", 1, [6, 7], k, v, False)
    finally:
        writer.close()


def test_a_stale_tag_is_taken_over_by_the_next_transfer_into_its_blocks(closing) -> None:
    """A move's failed pre-copy, then its tail into the same blocks: the tail owns them, the pre-copy's writer not."""
    fp, cache, r, s = _pair(closing)
    r.expect("rid:precopy", [1, 2])
    r.abort("rid:precopy")
    r.expect("rid", [1, 2, 3])
    assert {int(t) for t in cache.segment._map.tags[[1, 2, 3]]} == {tag_of("rid")}
    r.poll()
    assert {int(t) for t in cache.segment._map.tags[[1, 2, 3]]} == {tag_of("rid")}  # the pre-copy's end clears none


def test_an_int8_wire_goes_inline_and_a_sender_that_disallows_direct_gets_a_ring(closing) -> None:
    fp, cache, r, s = _pair(closing, "float32", scfg=_cfg(kv_wire_dtype="int8"))
    r.expect("q", [1, 2])
    s.begin("q", r.address)
    for layer in range(fp.num_layers):
        s.send_layer("q", layer, [1, 2], *make_kv(fp, layer, 2, seed=1, specials=False))
    s.finish("q")
    rev, sev = _both(r, s)
    assert [e.state for e in rev + sev] == [TransferState.DONE] * 2 and cache.writes > 0 and r.direct_pieces == 0
    ring_sender = closing(Sender(fp, _cfg(direct_write=False), "shm"))
    r.expect("t", [3])
    ring_sender.begin("t", r.address)
    _send(ring_sender, fp, "t", [3], seed=2)
    rev, sev = _both(r, ring_sender)
    assert [e.state for e in rev + sev] == [TransferState.DONE] * 2 and cache.holds([3], seed=2)
    assert set(ring_sender.paths().values()) == {"shm-ring"}


def test_a_killed_sender_fails_its_transfer_and_leaves_nothing_behind(spawn, closing) -> None:
    before = {n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX)}
    fp = fingerprint("float16")
    cache = SegmentCache(fp)
    cfg = TransferConfig(deadline_s=15, lease_s=1.5, idle_session_s=1.0)
    r = closing(Receiver(fp, cache.sink, "shm+tcp://127.0.0.1:0", cfg, "shm", segment=cache.segment))
    r.expect("t", [1, 2, 3])
    with procs.stalled_sender(spawn, "shm", r.address, "t", [1, 2, 3]) as p:
        poll_until([r.poll], lambda e: r.direct_pieces >= 2, 10)
        assert r.direct_pieces == 2 and cache.writes == 0
        os.kill(p.pid, signal.SIGKILL)
        p.join(5)
        ev = poll_until([r.poll], lambda e: e, 10)
        assert ev[0].state == TransferState.FAILED and isinstance(ev[0].error, PeerGone)
        assert cache.tagged() == 0  # the killed writer's flock went with it
    assert {n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX)} == before  # a memfd has no name to leave


def test_an_announcement_is_checked_before_and_after_opening(closing) -> None:
    fp = fingerprint()
    segment = KVSegment(fp, 8)
    try:
        path, token, blocks = segment.announce()
        for bad in (
            [path, token],
            [path, token[:8], blocks],
            [path, token, 0],
            [path, True, blocks],
            ["/etc/passwd", token, blocks],
            ["kvc-1-0123456789abcdef.sock", token, blocks],
        ):
            with pytest.raises(ShmUnavailable, match="malformed"):
                SegmentWriter.open(fp, bad)
        with pytest.raises(ShmUnavailable, match="refused the token"):
            SegmentWriter.open(fp, [path, os.urandom(16), blocks])
        assert segment.handoffs_refused == 1
        with pytest.raises(ShmUnavailable, match="size"):
            SegmentWriter.open(fingerprint(layers=5), [path, token, blocks])
        with pytest.raises(ShmUnavailable, match="No such file"):
            SegmentWriter.open(fp, [path.replace("kvc-", "kvc-9"), token, blocks])
    finally:
        segment.close()
    assert not os.path.exists(path)  # the socket goes with the segment


def test_the_writer_maps_the_cache_ahead_of_its_writes() -> None:
    """Every page of a new request's blocks would cost the sender a fault on its first write (27 ms per 45 MiB here,
    against 6.6 ms for the copy): the writer maps them all once, off its I/O thread, so writes fault no more."""
    fp = fingerprint("float32", layers=4, heads=4, head_dim=64, block_size=16)  # 16 KiB of K per block: 4 pages
    segment = KVSegment(fp, 64)
    writer = SegmentWriter.open(fp, segment.announce())
    try:
        writer._toucher.join(timeout=10)
        assert not writer._toucher.is_alive()
        blocks = list(range(64))
        segment.claim("t", blocks)
        kv = [make_kv(fp, layer, 64, seed=1) for layer in range(fp.num_layers)]
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for layer, (k, v) in enumerate(kv):
            write_piece(writer, "t", layer, blocks, k, v, False)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        assert faults < 200, f"{faults} page faults writing 2048 pages"  # (unmapped: one per page at least)
    finally:
        writer.close()
        segment.close()


def test_a_writer_waits_for_the_lock_a_bounded_time(closing) -> None:
    """A receiver stopped while it holds the flock (it clears tags under it) cannot hang the sender's I/O thread."""
    fp = fingerprint()
    segment = KVSegment(fp, 8)
    writer = SegmentWriter.open(fp, segment.announce())
    try:
        segment.claim("t", [1])
        assert segment._map.lock(1.0)
        t0 = time.monotonic()
        with pytest.raises(ProtocolError, match="stayed locked"):
            write_piece(writer, "t", 0, [1], *make_kv(fp, 0, 1, seed=1), False)
        assert 0.9 <= time.monotonic() - t0 < 5
        segment._map.unlock()
        write_piece(writer, "t", 0, [1], *make_kv(fp, 0, 1, seed=1), False)
    finally:
        writer.close()
        segment.close()


def test_a_sender_cannot_write_the_owner_tags(closing) -> None:
    """The tags sit in a memfd sealed against new writable mappings once the receiver mapped it: a sender reads them,
    and neither its descriptor, nor a writable one it opens again through /proc/self, lets it tag blocks for itself."""
    fp = fingerprint()
    segment = KVSegment(fp, 8)
    writer = SegmentWriter.open(fp, segment.announce())
    try:
        assert not writer._map.tags.flags.writeable
        size = os.fstat(writer._map.fd).st_size
        with pytest.raises(PermissionError):
            mmap.mmap(writer._map.fd, size)  # read-only description
        again = os.open(f"/proc/self/fd/{writer._map.fd}", os.O_RDWR)
        try:
            with pytest.raises(PermissionError):
                mmap.mmap(again, size)  # sealed: F_SEAL_FUTURE_WRITE
            with pytest.raises(PermissionError):
                os.pwrite(again, b"\xff" * 8, 4096)
        finally:
            os.close(again)
        segment.claim("t", [1])  # the receiver's own mapping still writes them
        assert int(writer._map.tags[1]) == tag_of("t")
        k, v = make_kv(fp, 0, 1, seed=3)
        write_piece(writer, "t", 0, [1], k, v, digest=False)
    finally:
        writer.close()
        segment.close()


AS_OTHER_USER = """
import os, socket, sys
os.setgroups([]); os.setgid(65534); os.setuid(65534)
with socket.socket(socket.AF_UNIX) as s:
    try:
        s.connect(sys.argv[1])
        print("connected")
    except PermissionError:
        print("refused")
"""


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a process of another user")
def test_another_user_cannot_reach_the_cache_socket(closing) -> None:
    """Its folder is the user's 0700 one: another user's process stops at connect, before any exchange."""
    segment = KVSegment(fingerprint(), 8)
    try:
        run = subprocess.run(
            [sys.executable, "-c", AS_OTHER_USER, segment.announce()[0]], capture_output=True, text=True, timeout=30
        )
        assert run.stdout.strip() == "refused", run.stderr
    finally:
        segment.close()


def test_the_socket_file_of_a_killed_receiver_is_swept_by_the_next_one(closing) -> None:
    """A SIGKILLed decode worker leaves its socket file; the next segment on the node removes it once it is older
    than STALE_AGE_S and its pid is gone, and leaves a live receiver's and a young one alone."""
    from transfer.private_dir import runtime_dir
    from transfer.shm_ring import STALE_AGE_S

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    folder = runtime_dir()
    old = time.time() - STALE_AGE_S - 5
    stale, young, alive = (
        folder / f"kvc-{dead.pid}-{'a' * 16}.sock",
        folder / f"kvc-{dead.pid}-{'b' * 16}.sock",
        folder / f"kvc-{os.getpid()}-{'c' * 16}.sock",
    )
    for path in (stale, young, alive):
        path.touch()
    for path in (stale, alive):
        os.utime(path, (old, old))
    segment = KVSegment(fingerprint(), 8)
    try:
        assert not stale.exists() and young.exists() and alive.exists()
    finally:
        segment.close()
        young.unlink()
        alive.unlink()
