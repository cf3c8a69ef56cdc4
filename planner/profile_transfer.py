"""The transfer part of ``pdserve profile``: one request's KV, sender to receiver, on the configured backend.

In one process a sender and receiver move the KV through the same sockets, rings and copies as two workers on one
node, into a real engine's KV cache. At tensor-parallel degree N every rank takes its own heads at once, so rank 0's
share is what is timed, recorded against the whole request's bytes. ``auto`` is shm, as between two workers on one
node; ``nccl`` needs two GPUs in two processes, so shm is measured and recorded instead (the notes say so). Reading
the source blocks is not timed (the prefill worker does it inside its forward), nor the first transfer of each size
(it opens the session).
"""

from __future__ import annotations

import dataclasses
import secrets
import statistics
import time
from collections.abc import Callable

import torch

from engine.llm_engine import LLMEngine
from planner.profile_model import TransferPoint
from transfer.base import make_receiver, make_sender
from transfer.state import TransferState
from transfer.wire import ModelFingerprint
from worker.rank_kv import receiver_address
from worker.spec import WorkerSpec


def transfer_backend(spec: WorkerSpec) -> tuple[WorkerSpec, str, str]:
    """(spec to measure with, backend name to record, a note): ``auto`` between two workers on one node is shm."""
    backend = spec.transfer_backend
    if backend == "auto":
        return spec, "shm", "transfer: backend auto, measured as two workers on one node resolve it (shm)"
    if backend == "nccl":
        note = "transfer: nccl needs two GPUs in two processes, not measured here; shm measured instead"
        return dataclasses.replace(spec, transfer_backend="shm"), "shm", note
    return spec, backend, f"transfer: backend {backend}"


def measure_transfer(
    engine: LLMEngine, spec: WorkerSpec, blocks: list[int], repeats: int, tick: Callable[[], object]
) -> tuple[str, str, list[TransferPoint]]:
    """(backend recorded, note, one point per block count in ``blocks``: the median of ``repeats`` transfers)."""
    spec, backend, note = transfer_backend(spec)
    config = dataclasses.replace(spec.transfer, secret=spec.transfer.secret or secrets.token_hex(16))
    kv_spec, whole = engine.kv_spec, engine.handoff_spec  # rank 0's heads; the model's
    split = engine.runner.head_split
    fingerprint = ModelFingerprint.from_spec(whole)
    if split is not None:
        fingerprint = fingerprint.slice(split.kv_start, split.kv_heads)

    def sink(
        _tid: str, layer: int, blocks: list[int], k: torch.Tensor, v: torch.Tensor, heads: tuple[int, int] | None = None
    ) -> None:
        engine.kv_cache.write_blocks(layer, blocks, k, v, heads)

    receiver = make_receiver(spec.transfer_backend, fingerprint, sink, receiver_address(spec), config)
    sender = make_sender(spec.transfer_backend, fingerprint, config)
    points = []
    try:
        for count in blocks:
            destination = list(range(count, 2 * count))
            shape = (count, kv_spec.block_size, kv_spec.num_kv_heads, kv_spec.head_dim)
            layers = [
                tuple(torch.randn(shape, device=engine.config.device).to(kv_spec.dtype) for _ in "kv")
                for _ in range(fingerprint.num_layers)
            ]
            times = [
                _one_transfer(sender, receiver, f"profile-{count}-{i}", destination, layers, config.deadline_s)
                for i in range(repeats + 1)
            ][1:]  # the first one opens the session
            points.append(TransferPoint(count * whole.bytes_per_block, statistics.median(times)))
            tick()
    finally:
        sender.close()
        receiver.close()
    return backend, note, points


def _one_transfer(sender, receiver, tid: str, destination: list[int], layers, timeout_s: float) -> float:
    """Seconds from ``begin`` until the receiver holds every layer; then waits (untimed) for the sender's ack."""
    receiver.expect(tid, destination)
    start = time.perf_counter()
    sender.begin(tid, receiver.address)
    for layer, (k, v) in enumerate(layers):
        if not sender.send_layer(tid, layer, destination, k, v):
            raise RuntimeError(f"transfer {tid}: the sender refused layer {layer}")
    sender.finish(tid)
    elapsed = _wait_for(receiver.poll, tid, timeout_s) - start
    _wait_for(sender.poll, tid, timeout_s)
    return elapsed


def _wait_for(poll: Callable[[], list], tid: str, timeout_s: float) -> float:
    """Poll until ``tid`` ends; returns when (perf_counter). RuntimeError if it failed or took over ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for event in poll():
            if event.transfer_id == tid:
                if event.state != TransferState.DONE:
                    raise RuntimeError(f"transfer {tid} failed: {event.error!r}")
                return time.perf_counter()
        time.sleep(0.0002)
    raise RuntimeError(f"transfer {tid} did not end within {timeout_s} s")
