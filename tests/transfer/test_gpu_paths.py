"""The transfer layer's GPU decisions, exercised on the CPU: GPU UUIDs in the nccl handshake (two workers on one GPU
take the same-node path, since NCCL refuses two ranks on one device), the pinned staging pool's bounds and reuse, and
the pass-through of host tensors. CUDA itself is faked only where a decision reads it (`gpu_uuid`); the pairs are real
zmq + gloo + shared memory. What needs a GPU to run (streams, events, pinned memory, NCCL) has not run here."""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.kv import Cache, fingerprint, make_kv, poll_until
from transfer.base import make_receiver, make_sender
from transfer.config import TransferConfig
from transfer.pair_path import gpu_uuid, same_gpu
from transfer.receiver import Receiver
from transfer.sender import Sender
from transfer.shm_ring import PREFIX, SHM_DIR
from transfer.staging import MIN_BUFFER_BYTES, PinnedPool, SideStreamSink, Stager
from transfer.state import TransferState
from transfer.wire import frame_view

pytestmark = pytest.mark.timeout(60)


def _segments() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX)}


def _send_all(s, r, tid: str, dst: list[int], seed: int, fp) -> None:
    r.expect(tid, dst)
    s.begin(tid, r.address)
    for layer in range(fp.num_layers):
        assert s.send_layer(tid, layer, dst, *make_kv(fp, layer, len(dst), seed=seed))
    s.finish(tid)
    events = poll_until([r.poll, s.poll], lambda e: len(e) >= 2, 30)
    assert [(e.transfer_id, e.state) for e in events] == [(tid, TransferState.DONE)] * 2, events


# ---------------------------------------------------------------------------------------------- GPU UUIDs


def test_gpu_uuid_comes_from_the_config_or_the_cuda_device(monkeypatch) -> None:
    assert gpu_uuid(TransferConfig()) is None  # CPU: no GPU to name
    assert gpu_uuid(TransferConfig(gpu_uuid="GPU-1")) == "GPU-1"
    dev_uuid = uuid.UUID("12345678-1234-5678-1234-567812345678")
    asked = []

    def props(device):
        asked.append(device)
        return SimpleNamespace(uuid=dev_uuid)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    assert gpu_uuid(TransferConfig(device="cuda:1")) == str(dev_uuid)
    assert asked == [torch.device("cuda:1")]
    assert gpu_uuid(TransferConfig(device="cpu")) is None  # gloo on a GPU host still moves host tensors


def test_same_gpu_needs_both_uuids_equal() -> None:
    assert same_gpu("GPU-a", "GPU-a")
    assert not same_gpu("GPU-a", "GPU-b")
    assert not same_gpu(None, None) and not same_gpu("GPU-a", None) and not same_gpu(None, "GPU-a")
    assert not same_gpu("GPU-a", b"GPU-a")  # a field of the wrong type is no match


def test_same_gpu_pair_uses_the_same_node_path(closing, caplog) -> None:
    before = _segments()
    fp = fingerprint("bfloat16")
    cache = Cache(fp)
    cfg = TransferConfig(gpu_uuid="GPU-aaaa", group_timeout_s=10.0)
    r = closing(make_receiver("gloo", fp, cache.sink, "tcp://127.0.0.1:0", cfg))
    s = closing(make_sender("gloo", fp, cfg))
    assert isinstance(r, Receiver) and isinstance(s, Sender) and r.transport == s.transport == "dist"
    assert r.address.startswith("tcp://")  # a plain address: the transport (dist) is in the hello
    with caplog.at_level("INFO", logger="transfer"):
        _send_all(s, r, "t", [1, 2, 3], seed=4, fp=fp)
    cache.assert_holds([1, 2, 3], seed=4)
    assert r.same_gpu_sessions == 1 and s.same_gpu_peers == 1  # both ends saw the other's UUID over the wire
    assert r._handshake.store is None  # no rendezvous store, so no pair group was ever formed
    assert r.rings() == 1 and r.shm_pieces == fp.num_layers == s.shm_pieces  # the pieces went through the ring
    assert not [t for t in threading.enumerate() if t.name.startswith("kv-pair-")]
    assert sum("same-node path" in m for m in caplog.messages) == 2  # one line each side
    s.close()
    r.close()
    assert _segments() - before == set()


@pytest.mark.parametrize(("rx_gpu", "tx_gpu"), [("GPU-aaaa", "GPU-bbbb"), ("GPU-aaaa", None), (None, None)])
def test_different_or_unknown_gpus_form_a_pair_group(rx_gpu, tx_gpu, closing) -> None:
    fp = fingerprint("float32")
    cache = Cache(fp)
    r = closing(
        make_receiver("gloo", fp, cache.sink, "tcp://127.0.0.1:0", TransferConfig(gpu_uuid=rx_gpu, group_timeout_s=10))
    )
    s = closing(make_sender("gloo", fp, TransferConfig(gpu_uuid=tx_gpu, group_timeout_s=10)))
    _send_all(s, r, "t", [5, 6], seed=2, fp=fp)
    cache.assert_holds([5, 6], seed=2)
    assert r.same_gpu_sessions == 0 and s.same_gpu_peers == 0
    assert r._handshake.store is not None and r.rings() == 0 and r.shm_pieces == 0  # the tensors went by the pair group
    s.close()
    r.close()


def test_the_decision_reads_the_cuda_device_when_no_uuid_is_configured(monkeypatch) -> None:
    """Two workers whose CUDA device reports the same UUID decide 'same GPU' (the real code path, CUDA faked)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(uuid="GPU-same"))
    assert same_gpu(gpu_uuid(TransferConfig(device="cuda")), gpu_uuid(TransferConfig(device="cuda:0")))


# ---------------------------------------------------------------------------------------------- staging


def test_pool_reuses_buffers_and_stays_within_its_bound() -> None:
    pool = PinnedPool(4 * MIN_BUFFER_BYTES, pin=False)  # pinning needs CUDA: the bounds are the same without
    a = pool.acquire(1000)
    assert a is not None and a.numel() == 1000 and pool.stats()["lent"] == 1
    a_ptr = a.data_ptr()
    del a  # the last view gone: the buffer is back
    assert pool.lent == 0
    b = pool.acquire(MIN_BUFFER_BYTES)
    assert b is not None and b.data_ptr() == a_ptr and pool.allocations == 1 and pool.reuses == 1
    c = pool.acquire(2 * MIN_BUFFER_BYTES)
    assert c is not None and pool.held_bytes == 3 * MIN_BUFFER_BYTES
    assert pool.acquire(2 * MIN_BUFFER_BYTES) is None and pool.fallbacks == 1  # would pass the bound: refused
    assert pool.acquire(5 * MIN_BUFFER_BYTES) is None and pool.fallbacks == 2  # larger than the bound itself
    assert pool.held_bytes <= pool.max_bytes
    del c  # idle buffers give way to a new size that would not fit next to them
    d = pool.acquire(3 * MIN_BUFFER_BYTES // 2 + 1)  # rounds up to 2x: reuses the idle 2x buffer
    assert d is not None and pool.reuses == 2
    del b, d
    assert pool.lent == 0 and pool.held_bytes <= pool.max_bytes


def test_a_lent_buffer_stays_lent_while_any_view_of_it_lives() -> None:
    """A zero-copy send keeps a memoryview of the frame (frame_view): the buffer must not be reused under it."""
    pool = PinnedPool(MIN_BUFFER_BYTES, pin=False)
    t = pool.acquire(4096)
    assert t is not None
    t.view(torch.float32).fill_(1.5)
    mv = frame_view(t.view(torch.float32).view(8, 128))
    del t
    assert pool.lent == 1 and pool.acquire(4096) is None  # the only buffer is still lent
    del mv
    assert pool.lent == 0
    again = pool.acquire(4096)
    assert again is not None and pool.allocations == 1


def test_pool_is_thread_safe_under_concurrent_loans() -> None:
    pool = PinnedPool(8 * MIN_BUFFER_BYTES, pin=False)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for i in range(200):
                t = pool.acquire(1 + (i * 997) % MIN_BUFFER_BYTES)
                if t is not None:
                    t.fill_(7)
                    assert int(t[0]) == 7
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert errors == [] and pool.lent == 0 and pool.held_bytes <= pool.max_bytes


def test_host_tensors_pass_through_the_stager_untouched() -> None:
    stager = Stager(1 << 20)
    k, v = torch.randn(2, 4, 2, 8), torch.randn(2, 4, 2, 8)
    staged = stager.stage([k, v])
    hk, hv = staged.wait(1.0)
    assert hk.data_ptr() == k.data_ptr() and hv.data_ptr() == v.data_ptr()  # no copy on the CPU
    assert stager.staged == 0 and stager.pool.allocations == 0


def test_zmq_sender_with_host_kv_never_touches_the_pool(closing) -> None:
    fp = fingerprint("bfloat16")
    cache = Cache(fp)
    r = closing(make_receiver("zmq", fp, cache.sink, "tcp://127.0.0.1:0", TransferConfig()))
    s = closing(make_sender("zmq", fp, TransferConfig(staging_bytes=1 << 20)))
    _send_all(s, r, "t", [0, 1], seed=6, fp=fp)
    cache.assert_holds([0, 1], seed=6)
    assert s._stager.pool.allocations == 0 and s._stager.staged == 0


def test_side_stream_sink_is_the_plain_sink_on_the_cpu() -> None:
    calls = []
    sink = SideStreamSink(lambda *a: calls.append(a), "cpu")
    k = torch.zeros(1, 4, 2, 8)
    sink("t", 0, [3], k, k)
    sink.fence()
    assert not sink.active and len(calls) == 1 and calls[0][2] == [3] and sink.writes == 0


def test_staging_bytes_must_be_positive() -> None:
    with pytest.raises(ValueError, match="staging_bytes"):
        TransferConfig(staging_bytes=0)


def test_a_stalled_staging_copy_fails_its_transfer_within_the_timeout() -> None:
    """StagedTensors.wait is bounded: an event that never completes is a TransferTimeout, never a hang."""
    from transfer.errors import TransferTimeout
    from transfer.staging import StagedTensors

    never = SimpleNamespace(query=lambda: False)
    staged = StagedTensors([torch.zeros(1)], done=never)
    t0 = time.monotonic()
    with pytest.raises(TransferTimeout):
        staged.wait(0.05)
    assert time.monotonic() - t0 < 1.0


# ---------------------------------------------------------------------------------------------- on a GPU only
# These run where CUDA is (a GPU machine's CI, `make gpu-check`'s host); on this CPU box they are skipped.

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class DeviceCache:
    """A KV cache on the GPU (the decode engine's shape), written the way engine.kv_cache.write_blocks does."""

    def __init__(self, fp, num_blocks: int = 32) -> None:
        shape = (num_blocks, *fp.block_shape)
        self.fp = fp
        self.k = [torch.zeros(shape, dtype=fp.torch_dtype, device="cuda") for _ in range(fp.num_layers)]
        self.v = [torch.zeros(shape, dtype=fp.torch_dtype, device="cuda") for _ in range(fp.num_layers)]

    def sink(self, tid: str, layer: int, blocks: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        index = torch.tensor(blocks, dtype=torch.long, device="cuda")
        self.k[layer].index_copy_(0, index, k.to("cuda"))
        self.v[layer].index_copy_(0, index, v.to("cuda"))

    def assert_holds(self, dst: list[int], seed: int) -> None:
        torch.cuda.synchronize()
        for layer in range(self.fp.num_layers):
            k, v = make_kv(self.fp, layer, len(dst), seed)
            assert torch.equal(self.k[layer][dst].cpu().view(torch.int16), k.view(torch.int16))
            assert torch.equal(self.v[layer][dst].cpu().view(torch.int16), v.view(torch.int16))


def _send_device_kv(s, r, tid: str, dst: list[int], seed: int, fp) -> None:
    r.expect(tid, dst)
    s.begin(tid, r.address)
    for layer in range(fp.num_layers):
        k, v = make_kv(fp, layer, len(dst), seed)
        assert s.send_layer(tid, layer, dst, k.cuda(), v.cuda())
    s.finish(tid)
    events = poll_until([r.poll, s.poll], lambda e: len(e) >= 2, 60)
    assert [(e.transfer_id, e.state) for e in events] == [(tid, TransferState.DONE)] * 2, events


@cuda
def test_pool_pins_its_buffers_on_cuda() -> None:
    pool = PinnedPool(1 << 20)
    t = pool.acquire(4096)
    assert pool.pin and t is not None and t.is_pinned()


@cuda
@pytest.mark.parametrize("backend", ["zmq", "shm"])
def test_device_kv_is_staged_and_written_on_side_streams(backend, closing) -> None:
    fp = fingerprint("bfloat16")
    cache = DeviceCache(fp)
    address = "tcp://127.0.0.1:0" if backend == "zmq" else "shm+tcp://127.0.0.1:0"
    r = closing(make_receiver(backend, fp, cache.sink, address, TransferConfig(kv_device="cuda")))
    s = closing(make_sender(backend, fp, TransferConfig(staging_bytes=8 << 20)))
    _send_device_kv(s, r, "t", [2, 3, 4], seed=7, fp=fp)
    cache.assert_holds([2, 3, 4], seed=7)
    assert s._stager.staged == 2 * fp.num_layers and s._stager.pool.allocations >= 1
    assert s._stager.pool.fallbacks == 0 and r._sink.writes == fp.num_layers
    end = time.monotonic() + 5
    while s._stager.pool.lent and time.monotonic() < end:  # ZeroMQ lets go of zero-copy frames asynchronously
        time.sleep(0.01)
    assert s._stager.pool.lent == 0


@cuda
def test_two_nccl_workers_on_one_gpu_use_the_same_node_path(closing) -> None:
    fp = fingerprint("bfloat16")
    cache = DeviceCache(fp)
    cfg = TransferConfig(device="cuda", kv_device="cuda", group_timeout_s=30.0)
    r = closing(make_receiver("nccl", fp, cache.sink, "tcp://127.0.0.1:0", cfg))
    s = closing(make_sender("nccl", fp, cfg))
    _send_device_kv(s, r, "t", [1, 5], seed=3, fp=fp)
    cache.assert_holds([1, 5], seed=3)
    assert r.same_gpu_sessions == 1 and s.same_gpu_peers == 1 and r._handshake.store is None  # NCCL never tried


# ---------------------------------------------------------------------------------------------- receiver side stream
# The stream and event calls are faked (they need CUDA); the pinned pool, the copies out of the receive buffers and
# the bookkeeping of which buffer a pending copy still reads are the real code.


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name, self.waited_on = name, []

    def wait_stream(self, other) -> None:
        self.waited_on.append(other.name)


class FakeEvent:
    pending: list = []  # every event recorded and not yet completed, in order

    def __init__(self) -> None:
        self.done = False

    def record(self, stream) -> None:
        self.stream = stream
        FakeEvent.pending.append(self)

    def query(self) -> bool:
        return self.done


class FakeDeviceTensor:
    """A received nccl buffer: on the device, read by the side stream."""

    is_cuda = True

    def __init__(self) -> None:
        self.recorded = []

    def record_stream(self, stream) -> None:
        self.recorded.append(stream.name)


@pytest.fixture
def fake_cuda_streams(monkeypatch):
    consumer = FakeStream("consumer")
    made: list[FakeStream] = []

    def new_stream(device=None):
        made.append(FakeStream(f"side{len(made)}"))
        return made[-1]

    FakeEvent.pending = []
    monkeypatch.setattr(torch.cuda, "Stream", new_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: consumer)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    uploads: list[int] = []

    def upload(self, host):
        uploads.append(host.data_ptr())  # not the tensor: holding it would keep its pinned buffer lent
        return host.clone()  # what arrives on the device: the bytes of the pinned buffer at copy time

    monkeypatch.setattr(SideStreamSink, "_upload", upload)
    return SimpleNamespace(consumer=consumer, made=made, uploads=uploads)


def test_host_kv_reaches_the_device_through_pinned_buffers_on_the_side_stream(fake_cuda_streams) -> None:
    got = []
    sink = SideStreamSink(lambda tid, layer, blocks, k, v: got.append((k, v)), "cuda", staging_bytes=1 << 20)
    ring = torch.arange(2 * 4 * 2 * 8, dtype=torch.float32).view(2, 4, 2, 8)  # a region of the receive buffer
    expected = ring.clone()
    sink("t", 0, [1, 2], ring[0], ring[1])
    ring.zero_()  # the sender reuses the region as soon as the sink returns
    k, v = got[0]
    assert torch.equal(k, expected[0]) and torch.equal(v, expected[1])  # copied out before the region was reused
    side = fake_cuda_streams.made[0]
    assert side.waited_on == ["consumer"] and sink.uploads == 2 and sink.fallbacks == 0
    assert len(fake_cuda_streams.uploads) == 2 and ring.data_ptr() not in fake_cuda_streams.uploads
    assert sink.pool is not None and sink.pool.lent == 2 and sink.in_flight == 1  # the copy may still read them
    FakeEvent.pending[0].done = True
    assert sink.in_flight == 0 and sink.pool.lent == 0  # the copy is done: the buffers are free again
    sink("t", 1, [1, 2], expected[0], expected[1])
    assert sink.pool.allocations == 2 and sink.pool.reuses == 2  # the same two buffers, not new pinned memory
    sink.fence()
    assert fake_cuda_streams.consumer.waited_on == ["side0"] and sink.writes == 2


def test_received_device_buffers_are_recorded_on_the_side_stream(fake_cuda_streams) -> None:
    got = []
    sink = SideStreamSink(lambda *args: got.append(args), "cuda")
    k, v = FakeDeviceTensor(), FakeDeviceTensor()
    sink("t", 3, [7], k, v)
    assert got == [("t", 3, [7], k, v)] and k.recorded == v.recorded == ["side0"]
    assert sink.uploads == 0 and sink.pool is None and sink.in_flight == 0  # nothing staged on the host


def test_a_piece_past_the_pinned_bound_is_still_written(fake_cuda_streams, monkeypatch) -> None:
    got = []
    sink = SideStreamSink(lambda tid, layer, blocks, k, v: got.append(k), "cuda", staging_bytes=MIN_BUFFER_BYTES)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **kw: self.clone())  # the pageable copy, faked
    big = torch.ones(MIN_BUFFER_BYTES // 4 + 1)  # one float over the pool's only buffer
    sink("t", 0, [0], big, big)
    assert sink.fallbacks == 2 and sink.uploads == 0 and torch.equal(got[0], big)
