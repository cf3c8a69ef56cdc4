"""What a worker's role tells its engine's memory plan, decided in ``resolve_spec`` (GPU visibility faked): a prefill
worker's engine only prefills (no decode graphs, no decode gather buffer), and a worker that moves KV over nccl
counts its pair groups' communicator buffers."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from worker.spec import DEFAULT_NCCL_PEERS, RuntimeOptions, WorkerSpec, resolve_spec


def _spec(role: str, backend: str, gpus: float = 1, **extra) -> WorkerSpec:
    return WorkerSpec(
        name=f"{role}-0",
        role=role,
        engine=EngineConfig(model="/nowhere"),
        runtime=RuntimeOptions(["tcp://127.0.0.1:1"]),
        transfer_backend=backend,
        gpus=gpus,
        **extra,
    )


@pytest.fixture
def a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_only_prefill_workers_get_a_prefill_only_engine(a_gpu):
    assert resolve_spec(_spec("prefill", "nccl")).engine.prefill_only
    assert not resolve_spec(_spec("decode", "nccl")).engine.prefill_only
    assert not resolve_spec(_spec("colocated", "zmq")).engine.prefill_only


def test_nccl_workers_count_their_pair_groups(a_gpu):
    assert resolve_spec(_spec("decode", "nccl")).engine.nccl_peers == DEFAULT_NCCL_PEERS
    assert resolve_spec(_spec("prefill", "nccl", nccl_peers=6)).engine.nccl_peers == 6
    assert resolve_spec(_spec("decode", "shm")).engine.nccl_peers == 0  # no NCCL communicator
    assert resolve_spec(_spec("colocated", "nccl")).engine.nccl_peers == 0  # moves no KV
    assert resolve_spec(_spec("decode", "gloo", gpus=0)).engine.nccl_peers == 0
