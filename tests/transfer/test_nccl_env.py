"""NCCL's process-wide settings: set once, at a worker process's start, never by a pair group while threads run.

A pair's timed-out op must not take a healthy worker down minutes later (NCCL's watchdog teardown, its dump on
timeout and its heartbeat monitor); the settings that stop it are read from the environment when a group is built.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from transfer import nccl_env, pairgroup
from transfer.nccl_env import NCCL_PROCESS_ENV


def test_the_settings_turn_off_every_path_that_aborts_the_process():
    assert NCCL_PROCESS_ENV == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
        "TORCH_NCCL_ENABLE_MONITORING": "0",
        "TORCH_NCCL_PROPAGATE_ERROR": "0",
    }
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
    assert nccl_env.missing(env) == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        "TORCH_NCCL_ENABLE_MONITORING": None,
        "TORCH_NCCL_PROPAGATE_ERROR": None,
    }
    assert nccl_env.missing(dict(NCCL_PROCESS_ENV)) == {}


def test_a_fresh_process_sets_them_at_its_start():
    code = (
        "import json, os; from transfer import nccl_env; nccl_env.set_at_process_start(); "
        "print(json.dumps({k: os.environ.get(k) for k in nccl_env.NCCL_PROCESS_ENV}))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_NCCL_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == NCCL_PROCESS_ENV


def test_setting_them_while_another_thread_runs_is_refused():
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, name="busy-thread", daemon=True)
    worker.start()
    environ: dict[str, str] = {}
    try:
        with pytest.raises(RuntimeError, match="before any other thread runs.*busy-thread"):
            nccl_env.set_at_process_start(environ)
    finally:
        stop.set()
        worker.join()
    assert environ == {}


class FakeNcclGroup:
    environs: list[dict] = []

    class Options:
        _timeout = None

    def __init__(self, store, rank, size, opts) -> None:
        FakeNcclGroup.environs.append(dict(os.environ))
        self.rank, self.size = rank, size


def _nccl_link() -> pairgroup.PairLink:
    link = pairgroup.PairLink.__new__(pairgroup.PairLink)  # its thread is not started: only _build runs
    link.backend, link.rank, link.key = "nccl", 0, "pair-key"
    link._store, link._store_addr = dist.HashStore(), ("127.0.0.1", 0)
    link._timeout, link._local_host = datetime.timedelta(seconds=1), "127.0.0.1"
    return link


def test_a_pair_group_never_changes_the_environment(monkeypatch, caplog):
    for name in NCCL_PROCESS_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNcclGroup, raising=False)  # a CPU build has none
    monkeypatch.setattr(pairgroup, "_WARNED_ENV", threading.Event())
    FakeNcclGroup.environs = []
    before = dict(os.environ)
    with caplog.at_level("WARNING", logger="transfer.pairgroup"):
        group = _nccl_link()._build()
        _nccl_link()._build()
    assert isinstance(group, FakeNcclGroup) and group.size == 2
    assert FakeNcclGroup.environs == [before, before] and dict(os.environ) == before
    warnings = [r.message for r in caplog.records if "started without" in r.message]
    assert len(warnings) == 1 and "TORCH_NCCL_ENABLE_MONITORING=0" in warnings[0]  # once per process


def test_no_warning_when_the_process_was_started_with_them(monkeypatch, caplog):
    for name, value in NCCL_PROCESS_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNcclGroup, raising=False)  # a CPU build has none
    monkeypatch.setattr(pairgroup, "_WARNED_ENV", threading.Event())
    with caplog.at_level("WARNING", logger="transfer.pairgroup"):
        _nccl_link()._build()
    assert not [r for r in caplog.records if "started without" in r.message]


PLACED = SimpleNamespace(id="placement-group")  # a Ray record always has its placement group


def _recording_pools(asked: list[dict]):
    """RayPools with no cluster: every actor class records the options it is started with."""
    from cluster.run.pools import RayPools

    class Remote:
        def options(self, **kwargs):
            asked.append(kwargs)
            return SimpleNamespace(remote=lambda spec, *rank: ("actor", spec.name, *rank))

    pools = RayPools.__new__(RayPools)
    pools._remote_cls = pools._leader_cls = pools._rank_cls = Remote()
    return pools


def test_ray_worker_actors_start_with_them():
    pytest.importorskip("ray")
    from cluster.run.pools import WorkerRecord

    asked: list[dict] = []
    spec = SimpleNamespace(name="decode-0", gpus=1.0)
    record = WorkerRecord("decode-0", "decode", None, spec=spec, group=PLACED)
    _recording_pools(asked)._start(
        record, SimpleNamespace(cpus_per_replica=2, resources=None, tensor_parallel_size=1, ranks=1)
    )
    assert record.actor == ("actor", "decode-0")
    assert asked[0]["runtime_env"] == {"env_vars": NCCL_PROCESS_ENV}
    assert asked[0]["name"] == "pdserve-decode-0" and asked[0]["num_gpus"] == 1.0


def test_every_tensor_parallel_rank_starts_with_them():
    pytest.importorskip("ray")
    import dataclasses

    from cluster.run.pools import WorkerRecord

    @dataclasses.dataclass
    class Spec:
        name: str
        gpus: float
        tp_rendezvous: str = ""

    asked: list[dict] = []
    record = WorkerRecord("prefill-0", "prefill", None, spec=Spec("prefill-0", 1.0), group=PLACED)
    _recording_pools(asked)._start(
        record, SimpleNamespace(cpus_per_replica=2, resources=None, tensor_parallel_size=3, ranks=3)
    )
    assert record.actor == ("actor", "prefill-0")
    assert record.ranks == [("actor", "prefill-0", 1), ("actor", "prefill-0", 2)]
    assert [a["name"] for a in asked] == ["pdserve-prefill-0-rank1", "pdserve-prefill-0-rank2", "pdserve-prefill-0"]
    assert all(a["runtime_env"] == {"env_vars": NCCL_PROCESS_ENV} for a in asked)
