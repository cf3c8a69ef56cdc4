"""WorkerSpec: the one value a worker is built from. The device is chosen inside the worker's process from the GPUs its
pool asked for (faked visibility here, so the rule is tested on a CPU box); nccl never quietly becomes gloo; a spec
survives pickling (Ray ships it to the actor); workers built from the config's specs serve and free everything."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from cluster.config import parse_config
from cluster.run.pools import LocalPools
from engine.config import EngineConfig
from transfer.config import TransferConfig
from worker.spec import RuntimeOptions, WorkerRole, WorkerSpec, resolve_device, resolve_spec

SECRET = "worker-spec-test-secret-0123456789abcdef"


def _spec(role: str = "prefill", gpus: float = 0, backend: str = "zmq", **extra) -> WorkerSpec:
    return WorkerSpec(
        name=f"{role}-7",
        role=role,
        engine=EngineConfig(model="/nowhere"),
        runtime=RuntimeOptions(["tcp://127.0.0.1:1"], secret=SECRET),
        transfer_backend=backend,
        gpus=gpus,
        **extra,
    )


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_a_worker_that_asked_for_no_gpu_runs_on_the_cpu_even_where_one_is_visible(a_gpu):
    assert resolve_device(_spec(gpus=0)) == "cpu"
    resolved = resolve_spec(_spec(gpus=0))
    assert resolved.engine.device == "cpu" and resolved.transfer.device == "cpu"


def test_a_worker_that_asked_for_a_gpu_gets_cuda_when_one_is_visible(a_gpu):
    assert resolve_device(_spec(gpus=0.5)) == "cuda"
    for backend, transfer_device in (("nccl", "cuda"), ("gloo", "cpu"), ("zmq", "cpu")):
        resolved = resolve_spec(_spec(role="decode", gpus=1, backend=backend))
        assert resolved.engine.device == "cuda" and resolved.transfer.device == transfer_device, backend


def test_a_worker_that_asked_for_a_gpu_and_sees_none_fails_naming_itself(no_gpu):
    with pytest.raises(RuntimeError, match=r"worker decode-7: .*1 GPU.* no GPU is visible to it"):
        resolve_device(_spec(role="decode", gpus=1))


def test_nccl_on_a_cpu_worker_fails_and_gloo_is_the_cpu_spelling(no_gpu):
    with pytest.raises(RuntimeError, match=r"worker prefill-7: transfer.backend is nccl.*gloo"):
        resolve_spec(_spec(backend="nccl"))
    resolved = resolve_spec(_spec(backend="gloo"))
    assert resolved.transfer_backend == "gloo" and resolved.transfer.device == "cpu"
    assert resolve_spec(_spec(role="colocated", backend="nccl")).engine.device == "cpu"  # moves no KV


def test_a_spec_checks_its_values_and_shares_one_secret():
    spec = _spec()
    assert spec.role is WorkerRole.PREFILL and spec.pool == "prefill"
    assert spec.transfer.secret == SECRET  # given once, used by the control plane and the KV handshake
    with pytest.raises(ValueError, match="differ"):
        _spec(transfer=TransferConfig(secret="another-secret-entirely-0123456789"))
    for field, value in (
        ("transfer_backend", "carrier-pigeon"),
        ("zmq_transport", "udp"),
        ("failure_policy", "retry"),
        ("role", "router"),
    ):
        with pytest.raises(ValueError, match=field if field != "role" else "WorkerRole"):
            dataclasses.replace(spec, **{field: value})
    assert spec.with_host("10.1.2.3").runtime.host == "10.1.2.3" and spec.runtime.host == "127.0.0.1"


def test_a_spec_survives_pickling_as_ray_ships_it():
    config = parse_config({"transfer": {"secret": SECRET, "backend": "gloo", "failure_policy": "recompute"}})
    for spec in config.worker_specs("/model", ["tcp://127.0.0.1:5000"], "127.0.0.1"):
        copy = pickle.loads(pickle.dumps(spec))
        assert copy == spec and copy.role is spec.role


def test_a_role_refuses_another_roles_spec(tiny_llama_path):
    from prefill.worker import PrefillRole
    from worker.runtime import WorkerRuntime

    spec = dataclasses.replace(_spec(role="decode"), engine=EngineConfig(model=str(tiny_llama_path)))
    with pytest.raises(ValueError, match="decode spec given to the prefill role"):
        WorkerRuntime(spec, PrefillRole)


def test_workers_fail_in_their_own_process_when_their_gpu_is_missing(tiny_llama_path, no_gpu):
    """The launcher decides nothing about devices: the worker itself refuses, naming itself (LocalPools runs the
    workers' constructors here, as a Ray actor runs them in its own process)."""
    config = parse_config(
        {
            "model": {"name": str(tiny_llama_path)},
            "pools": {"prefill": {"gpus_per_replica": 1}, "decode": {"gpus_per_replica": 1}},
            "transfer": {"secret": SECRET},
        }
    )
    with pytest.raises(RuntimeError, match="worker prefill-0: .*no GPU is visible"):
        LocalPools(config, str(tiny_llama_path), ["tcp://127.0.0.1:1"], "127.0.0.1")


def test_workers_built_from_the_configs_specs_run_on_the_cpu_and_free_everything(tiny_llama_path):
    """In-process pools from ``worker_specs``: each worker resolved its own device, took its role's settings from its
    spec, and holds nothing after it stops."""
    config = parse_config(
        {
            "model": {"name": str(tiny_llama_path), "max_model_len": 256},
            "pools": {
                "prefill": {"kv_blocks": 32, "torch_threads": 1},
                "decode": {"kv_blocks": 48, "torch_threads": 1, "reserve_headroom_tokens": 8},
            },
            "transfer": {"backend": "local", "secret": SECRET, "failure_policy": "recompute", "stream_layers": False},
        }
    )
    pools = LocalPools(config, str(tiny_llama_path), ["tcp://127.0.0.1:1"], "127.0.0.1")
    try:
        workers = {record.name: record.actor.worker for record in pools.workers}
        assert [(r.name, r.role) for r in pools.workers] == [("prefill-0", "prefill"), ("decode-0", "decode")]
        prefill, decode = workers["prefill-0"], workers["decode-0"]
        assert prefill.engine.config.device == decode.engine.config.device == "cpu"
        assert prefill.engine.block_manager.num_blocks == 32 and decode.engine.block_manager.num_blocks == 48
        assert prefill.role.stream_kv is False and decode.role.failure_policy == "recompute"
        assert decode.role.headroom_tokens == 8 and decode.info()["kv_address"].startswith("local://decode-0-")
        assert prefill.options.secret == decode.options.secret == SECRET
    finally:
        pools.stop()
    for worker in workers.values():
        worker.engine.check_no_leaks()
