"""The direct path on a GPU (backend nccl, same node): the decode worker's cache is announced by CUDA IPC handles and a
prefill worker that sees that GPU writes KV into its reserved blocks, instead of an NCCL pair.

Run on the CPU with the decision faked: the three driver calls of transfer/cuda_ipc.py (export a handle, open it,
list the GPUs this process sees) are replaced by an in-process table of CPU tensors; everything else is real (gloo
transport, handshake, owner tags under the flock, headers, the receiver's checks). What needs a GPU to run (the
driver calls, the writer's stream and event) runs in `make gpu-check`'s P/D pair.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.kv import bits, fingerprint, make_kv, poll_until, write_piece
from transfer import cuda_ipc
from transfer.config import TransferConfig
from transfer.errors import ProtocolError
from transfer.kv_segment import KVSegment, SegmentWriter, tag_of
from transfer.receiver import Receiver
from transfer.sender import Sender
from transfer.shm_ring import ShmUnavailable
from transfer.state import TransferState

pytestmark = pytest.mark.timeout(60)
RX_GPU, TX_GPU = "GPU-aaaa", "GPU-bbbb"


class FakeIpc:
    """Stands in for the CUDA driver only: a handle names a tensor of this process; the opener sees ``visible``."""

    def __init__(self, visible: list[str]) -> None:
        self.visible = visible
        self.tensors: dict[bytes, torch.Tensor] = {}
        self.opened = 0
        self.closed = 0

    def export(self, t: torch.Tensor) -> list:
        handle = os.urandom(cuda_ipc.HANDLE_BYTES)
        self.tensors[handle] = t
        return [handle, 0, t.numel() * t.element_size()]

    def opened_memory(self, gpu: str):
        fake = self
        if gpu not in self.visible:
            raise cuda_ipc.CudaIpcError(f"GPU {gpu} is not visible")

        class Opened:
            def tensor(self, exported):
                fake.opened += 1
                return fake.tensors[exported[0]].view(-1).view(torch.uint8)

            def close(self):
                fake.closed += 1

        return Opened()


@pytest.fixture
def ipc(monkeypatch):
    fake = FakeIpc([TX_GPU, RX_GPU])
    monkeypatch.setattr(cuda_ipc, "export", fake.export)
    monkeypatch.setattr(cuda_ipc, "OpenedMemory", fake.opened_memory)
    monkeypatch.setattr(cuda_ipc, "visible_gpus", lambda: list(fake.visible))
    return fake


class DeviceCache:
    """The decode side: the engine's own "device" layers, announced by handle; the sink counts pieces that came inline
    or by a pair group."""

    def __init__(self, fp, num_blocks: int = 40) -> None:
        shape = (2, num_blocks, *fp.block_shape)
        self.fp, self.writes = fp, 0
        self.layers = [torch.zeros(shape, dtype=fp.torch_dtype) for _ in range(fp.num_layers)]
        self.segment = KVSegment(fp, num_blocks, device_layers=self.layers, gpu=RX_GPU)

    def sink(self, tid, layer, blocks, k, v) -> None:
        index = torch.tensor(blocks)
        self.layers[layer][0][index] = k
        self.layers[layer][1][index] = v
        self.writes += 1

    def holds(self, dst, seed) -> bool:
        index = torch.tensor(dst)
        for layer in range(self.fp.num_layers):
            k, v = make_kv(self.fp, layer, len(dst), seed)
            kv = self.layers[layer]
            if not (torch.equal(bits(kv[0][index]), bits(k)) and torch.equal(bits(kv[1][index]), bits(v))):
                return False
        return True


def _cfg(gpu: str, **kw) -> TransferConfig:
    return TransferConfig(gpu_uuid=gpu, group_timeout_s=10.0, deadline_s=5.0, **kw)


def _pair(closing, tx_gpu=TX_GPU, dtype="float32", transport="dist", **scfg):
    """A decode side whose cache is on a "GPU", and a sender: nccl's transport (dist), or shm's (shm, auto)."""
    fp = fingerprint(dtype)
    cache = DeviceCache(fp)
    address = "tcp://127.0.0.1:0" if transport == "dist" else "shm+tcp://127.0.0.1:0"
    r = closing(Receiver(fp, cache.sink, address, _cfg(RX_GPU), transport, segment=cache.segment))
    s = closing(Sender(fp, _cfg(tx_gpu, **scfg), transport))
    return fp, cache, r, s


def _transfer(r, s, fp, tid, dst, seed):
    r.expect(tid, dst)
    s.begin(tid, r.address)
    for layer in range(fp.num_layers):
        assert s.send_layer(tid, layer, dst, *make_kv(fp, layer, len(dst), seed))
    s.finish(tid)
    rev, sev = [], []
    poll_until(
        [lambda: rev.extend(r.poll()) or [], lambda: sev.extend(s.poll()) or []],
        lambda _: bool(rev) and bool(sev),
        10.0,
    )
    return rev, sev


@pytest.mark.parametrize(
    ("tx_gpu", "transport"),
    [(TX_GPU, "dist"), (RX_GPU, "dist"), (TX_GPU, "shm")],
    ids=["nccl-another-gpu", "nccl-same-gpu", "shm-auto"],
)
def test_a_sender_that_sees_the_gpu_writes_into_the_cache_instead_of_pairing(tx_gpu, transport, ipc, closing) -> None:
    fp, cache, r, s = _pair(closing, tx_gpu, transport=transport)
    for i, dst in enumerate(([3], [7, 8, 9, 20, 2, 31])):
        rev, sev = _transfer(r, s, fp, f"t{i}", dst, seed=i)
        assert [e.state for e in rev + sev] == [TransferState.DONE] * 2, rev + sev
        assert cache.holds(dst, seed=i)
    assert cache.writes == 0 and r.direct_pieces == s.direct_pieces == 2 * fp.num_layers
    assert set(s.paths().values()) == {"cuda-ipc"}
    assert r._handshake.store is None and r.same_gpu_sessions == 0 and r.rings() == 0  # no pair group, no ring
    assert ipc.opened == fp.num_layers  # each layer's handle opened once, for both transfers
    assert not cache.segment._map.tags.any() and r.pending_transfers() == [] and s.active_transfers() == []
    s.close()
    assert ipc.closed == 1


@pytest.mark.parametrize("transport", ["dist", "shm"], ids=["nccl-pairs", "shm-ring"])
def test_a_sender_that_cannot_see_the_gpu_pairs_or_takes_the_ring_as_before(transport, ipc, closing) -> None:
    ipc.visible = [TX_GPU]  # Ray gave the prefill actor only its own GPU
    fp, cache, r, s = _pair(closing, transport=transport)
    rev, sev = _transfer(r, s, fp, "t", [5, 6], seed=2)
    assert [e.state for e in rev + sev] == [TransferState.DONE] * 2
    assert cache.holds([5, 6], seed=2) and cache.writes == fp.num_layers
    assert r.direct_pieces == 0 and ipc.opened == 0
    assert (
        (r._handshake.store is not None)
        if transport == "dist"
        else (r.rings() == 1 and s.paths() == {r.address: "shm-ring"})
    )


@pytest.mark.parametrize("scfg", [{"direct_write": False}, {"kv_wire_dtype": "int8"}], ids=["disallowed", "int8"])
def test_a_sender_that_does_not_ask_for_the_cache_pairs(scfg, ipc, closing) -> None:
    fp, cache, r, s = _pair(closing, **scfg)
    rev, sev = _transfer(r, s, fp, "t", [5, 6], seed=2)
    assert [e.state for e in rev + sev] == [TransferState.DONE] * 2
    assert r._handshake.store is not None and r.direct_pieces == 0 and ipc.opened == 0
    if "direct_write" in scfg:
        assert cache.holds([5, 6], seed=2)


def test_a_gpu_cache_carries_no_checksums_and_refuses_one(ipc, closing) -> None:
    fp, cache, r, s = _pair(closing, checksum=True)
    rev, _ = _transfer(r, s, fp, "t", [1, 2], seed=3)
    assert rev[0].state == TransferState.DONE  # the writer sent no xxh3 for device memory, as over NCCL
    spec = type("F", (), {"xxh3": 1})()
    cache.segment.claim("u", [4])
    with pytest.raises(ProtocolError, match="GPU cache"):
        cache.segment.verify(0, [4], [spec, spec])


def test_a_closed_cache_refuses_every_writer(ipc) -> None:
    fp = fingerprint("float32")
    cache = DeviceCache(fp)
    writer = SegmentWriter.open(fp, cache.segment.announce())
    try:
        cache.segment.claim("t", [1])
        assert writer.on_device and cache.segment._map.tags[1] == tag_of("t")
        k, v = make_kv(fp, 0, 1, seed=1)
        write_piece(writer, "t", 0, [1], k, v, digest=False)
        cache.segment.close()  # the memory goes back to the allocator: no write may land from now on
        with pytest.raises(ProtocolError, match="not reserved"):
            write_piece(writer, "t", 0, [1], k, v, digest=False)
    finally:
        writer.close()


def test_an_unopenable_gpu_cache_is_refused_before_any_write(ipc) -> None:
    fp = fingerprint("float32")
    cache = DeviceCache(fp)
    good = cache.segment.announce()
    ipc.visible = [TX_GPU]
    with pytest.raises(ShmUnavailable, match="not visible"):
        SegmentWriter.open(fp, good)
    ipc.visible = [RX_GPU]
    gpu, exports = good[3]
    malformed = ([gpu, exports[:-1]], [gpu, [[*exports[0][:2], 12], *exports[1:]]], [7, exports], "x", [gpu])
    for bad in malformed:
        with pytest.raises(ShmUnavailable):
            SegmentWriter.open(fp, [*good[:3], bad])
    cache.segment.close()


def test_the_real_driver_calls_refuse_what_they_cannot_share() -> None:
    """No fake: on this CPU box a host tensor has no handle, and a GPU this process cannot see cannot be opened."""
    with pytest.raises(cuda_ipc.CudaIpcError):
        cuda_ipc.export(torch.zeros(4))
    with pytest.raises(cuda_ipc.CudaIpcError, match="not visible"):
        cuda_ipc.OpenedMemory("GPU-not-here")
    fp = fingerprint("float32")
    layers = [torch.zeros((2, 4, *fp.block_shape)) for _ in range(fp.num_layers)]
    with pytest.raises(ShmUnavailable, match="no CUDA IPC handles"):
        KVSegment(fp, 4, device_layers=layers, gpu=RX_GPU)
    if not torch.cuda.is_available():
        assert cuda_ipc.visible_gpus() == []


class RecordingPath:
    def __init__(self, device_kv: bool) -> None:
        self.device_kv, self.got = device_kv, []

    def send(self, sender, peer, outs) -> None:
        self.got.extend(out.tensors for out in outs)


@pytest.mark.parametrize("device_kv", [True, False], ids=["gpu-cache", "host-path"])
def test_device_kv_goes_to_a_gpu_cache_as_it_is_and_to_other_paths_through_the_host(device_kv, closing) -> None:
    """What no CPU tensor can show: the sender stages device KV to host memory only for paths that need host bytes
    (tensors stand in by their is_cuda alone; the staging is recorded, not run)."""
    from types import SimpleNamespace

    from transfer.outbox import Outgoing
    from transfer.wire import encode_piece

    fp = fingerprint("float32")
    s = closing(Sender(fp, _cfg(TX_GPU), "dist"))
    staged = []
    s._stager = SimpleNamespace(stage=lambda ts, after=None: staged.append(ts) or SimpleNamespace(wait=lambda _: ts))
    header, _ = encode_piece(fp, "t", 0, [1], *make_kv(fp, 0, 1, seed=1), "raw", False)
    device = [SimpleNamespace(is_cuda=True), SimpleNamespace(is_cuda=True)]
    path = RecordingPath(device_kv)
    peer = SimpleNamespace(path=path, check_frame_bound=lambda piece: None)
    s._send(peer, Outgoing("t", header, list(device), 8))
    assert path.got == [device]
    assert staged == ([] if device_kv else [device])
