"""Live role switching (cluster/run/role_switch.py): a worker moves between the prefill and decode pools under load,
keeping its weights; every stream completes with the tokens it gets when replayed alone, nothing leaks, a command
for the old role is refused, and a switch that cannot drain is called off.

In-process clusters (LocalPools, the tiny model); the ``serve`` fixture checks at teardown that every block is free
and no request is held anywhere.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import zmq

from cluster.routing.errors import ScaleError
from engine.request import SamplingParams
from tests.helpers.cluster import metric_value, wait_until, worker_named
from transfer.zap import connect_curve, plane_keys
from worker.messages import Reserve
from worker.protocol import Channel, Signer, zmq_endpoint

pytestmark = pytest.mark.timeout(180)


class Load:
    """Greedy completions from threads: each prompt's text as its client saw it."""

    def __init__(self, url: str, model: str, max_tokens: int) -> None:
        self.url, self.model, self.max_tokens = url, model, max_tokens
        self.texts: dict[str, str | None] = {}
        self.threads: list[threading.Thread] = []

    @classmethod
    def of(cls, handle, max_tokens: int) -> Load:
        return cls(handle.base_url, handle.config.served_model_name, max_tokens)

    def start(self, prompts: list[str]) -> None:
        for prompt in prompts:
            self.texts[prompt] = None
            thread = threading.Thread(target=self._run, args=(prompt,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def complete(self, prompt: str) -> str:
        body = {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0.0}
        response = httpx.post(f"{self.url}/v1/completions", json={**body, "ignore_eos": True}, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    def _run(self, prompt: str) -> None:
        self.texts[prompt] = self.complete(prompt)

    def join(self) -> dict[str, str | None]:
        for thread in self.threads:
            thread.join(150)
        assert not any(t.is_alive() for t in self.threads)
        return self.texts


def _holds(handle, worker: str) -> bool:
    try:
        return any(
            worker in (f.decode, f.prefill) and f.num_output_tokens > 1 for f in list(handle.router.flows.values())
        )
    except RuntimeError:  # changed while read (another thread): the next look sees it
        return False


def _replayed_alone(load: Load, texts: dict[str, str | None]) -> None:
    """Every stream's text is what the same greedy request gets with nothing else in flight."""
    for prompt, text in texts.items():
        assert text is not None, prompt
        assert load.complete(prompt) == text, prompt


def test_a_decode_worker_becomes_a_prefill_worker_under_load(serve):
    handle = serve(pools={"decode": {"replicas": 2, "torch_threads": 1, "kv_blocks": 160}})
    before = worker_named(handle, "decode-1")
    model = before.engine.model
    load = Load.of(handle, max_tokens=48)
    load.start([f"tell me a story about {i}" for i in range(6)])
    wait_until(lambda: _holds(handle, "decode-1"), timeout_s=30)
    answer = handle.scaler.switch_role("decode-1", "prefill", drain_timeout_s=60, wait=True)
    switch = answer["switch"]
    assert switch["phase"] == "done", switch
    assert switch["from_role"] == "decode" and switch["to"] == "prefill"
    assert switch["drain_s"] > 0 and switch["reconfigure_s"] > 0
    assert answer["pools"]["prefill"]["workers"] == ["prefill-0", "decode-1"]
    assert answer["pools"]["decode"]["workers"] == ["decode-0"]
    sent_before = before.counters.transfers_ok
    load.start([f"after the switch {i}" for i in range(4)])
    texts = load.join()
    _replayed_alone(load, texts)

    after = worker_named(handle, "decode-1")
    assert after is before and after.engine.model is model  # the same process and weights: no load
    info = after.info()
    assert info["role"] == "prefill" and info["epoch"] == 1
    assert after.engine.block_manager.num_blocks == 96  # the prefill pool's KV, not the decode pool's 160
    assert after.counters.role_switches == 1
    assert after.counters.transfers_ok > sent_before  # it prefilled and sent KV to decode-0
    handle_view = handle.router.members.workers["decode-1"]
    assert handle_view.role == "prefill" and handle_view.state.value == "active"
    status = httpx.get(f"{handle.base_url}/status", timeout=5).json()
    assert "decode-1" in status["pools"]["prefill"]["workers"]
    url, key = handle.base_url, handle.config.router.api_key
    assert metric_value(url, "pdserve_role_switches_total", key, to="prefill", result="done") == 1.0
    membership = handle.scaler.scale("prefill", 1)  # the newest of the pool leaves: the worker that joined it
    assert membership["pools"]["prefill"]["draining"] == ["decode-1"]
    assert handle.scaler.wait_idle(60)


def test_a_prefill_worker_becomes_a_decode_worker_and_decodes(serve):
    handle = serve(pools={"prefill": {"replicas": 2, "torch_threads": 1, "kv_blocks": 96}})
    load = Load.of(handle, max_tokens=24)
    load.start([f"a prompt for the prefill pool {i}" for i in range(4)])
    answer = handle.scaler.switch_role("prefill-1", "decode", drain_timeout_s=60, wait=True)
    assert answer["switch"]["phase"] == "done", answer
    worker = worker_named(handle, "prefill-1")
    assert worker.engine.block_manager.num_blocks == 160 and not worker.engine.config.prefill_only
    handle.scaler.scale("decode", 1)  # there is one decode worker besides it: this removes nothing
    # only it decodes now: decode-0 drains away
    handle.router.drain_worker_threadsafe("decode-0", 30)
    load.start([f"decoded on the switched worker {i}" for i in range(3)])
    wait_until(lambda: any(f.decode == "prefill-1" for f in list(handle.router.flows.values())), timeout_s=30)
    texts = load.join()
    _replayed_alone(load, texts)
    assert worker.counters.role_switches == 1


def test_a_command_sealed_for_the_old_role_is_refused(serve):
    handle = serve(pools={"decode": {"replicas": 2, "torch_threads": 1, "kv_blocks": 160}})
    worker = worker_named(handle, "decode-1")
    old_address = worker.command_address
    handle.scaler.switch_role("decode-1", "prefill", wait=True)
    assert worker.command_address != old_address
    assert zmq_endpoint(worker.command_address) == zmq_endpoint(old_address)  # the same socket, a new epoch
    rejected = worker.counters.control_rejected
    secret = handle.config.transfer.secret
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)
        connect_curve(sock, plane_keys(secret))
        sock.connect(zmq_endpoint(old_address))
        stale = Reserve("for-the-old-role", [1, 2, 3], SamplingParams(max_tokens=4))
        sock.send(Signer(secret, Channel.COMMANDS, old_address).seal(stale))
        wait_until(lambda: worker.counters.control_rejected > rejected, timeout_s=10)
        sock.close()
    finally:
        ctx.destroy(linger=0)
    assert "for-the-old-role" not in worker.engine.requests


def test_a_switch_that_cannot_drain_in_time_is_called_off(serve):
    """decode-0 drains, so decode-1's slowed stream can neither move away nor end in time; the switch is called off
    at its deadline and decode-1 decodes on as before."""
    handle = serve(pools={"decode": {"replicas": 2, "torch_threads": 1, "kv_blocks": 160}})
    handle.router.drain_worker_threadsafe("decode-0", 60)  # every new request goes to decode-1, and no move to decode-0
    slow = worker_named(handle, "decode-1")
    slow.engine.set_layer_hook(lambda layer, batch: time.sleep(0.005))  # a step of tens of ms
    load = Load.of(handle, max_tokens=100)
    load.start(["a long story that stays where it is"])
    wait_until(lambda: _holds(handle, "decode-1"), timeout_s=30)
    answer = handle.scaler.switch_role("decode-1", "prefill", drain_timeout_s=0.5, wait=True)
    slow.engine.set_layer_hook(None)
    assert answer["switch"]["phase"] == "called_off", answer
    view = handle.router.members.workers["decode-1"]
    assert view.role == "decode" and view.state.value == "active" and view.switch is None
    texts = load.join()
    assert all(t is not None for t in texts.values())
    url, key = handle.base_url, handle.config.router.api_key
    assert metric_value(url, "pdserve_role_switches_total", key, to="prefill", result="called_off") == 1.0
    assert worker_named(handle, "decode-1").info()["epoch"] == 0


def test_bad_switches_are_refused_naming_the_field(serve):
    handle = serve()
    with pytest.raises(ScaleError) as last:
        handle.scaler.switch_role("decode-0", "prefill")
    assert last.value.param == "worker" and "last decode worker" in str(last.value)
    for worker, to, param in [("decode-0", "decode", "to"), ("nobody", "prefill", "worker"), ("decode-0", "x", "to")]:
        with pytest.raises(ScaleError) as refused:
            handle.scaler.switch_role(worker, to)
        assert refused.value.param == param
    response = httpx.post(
        f"{handle.base_url}/admin/role",
        json={"worker": "decode-0", "to": "sideways"},
        headers=handle.admin_headers,
        timeout=10,
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "to"


def test_a_worker_that_fails_mid_switch_is_started_again_in_its_new_role(serve, monkeypatch):
    handle = serve(pools={"decode": {"replicas": 2, "torch_threads": 1, "kv_blocks": 160}})
    broken = worker_named(handle, "decode-1")

    def die(config):
        raise RuntimeError("the worker's process died while it rebuilt")

    monkeypatch.setattr(broken.engine, "reconfigured", die)
    answer = handle.scaler.switch_role("decode-1", "prefill", wait=True)
    assert answer["switch"]["phase"] == "restarted", answer
    assert "died while it rebuilt" in answer["switch"]["error"]
    fresh = worker_named(handle, "decode-1")
    assert fresh is not broken and fresh.info()["role"] == "prefill"
    view = handle.router.members.workers["decode-1"]
    assert view.role == "prefill" and view.state.value == "active"
    url, key = handle.base_url, handle.config.router.api_key
    assert metric_value(url, "pdserve_role_switches_total", key, to="prefill", result="restarted") == 1.0
    load = Load.of(handle, max_tokens=8)
    load.start([f"served after the restart {i}" for i in range(3)])
    assert all(t is not None for t in load.join().values())


@pytest.mark.e2e  # a `pdserve serve` process on Ray, switched by `pdserve role`: `make test-e2e`
@pytest.mark.timeout(300)
def test_pdserve_role_against_a_running_pdserve_serve(tiny_llama_path, tmp_path):
    """The CLI as a user runs it, against `pdserve serve` (Ray actors): decode-1 becomes a prefill worker and back,
    in place (the same process: its heartbeat counts the switch as epoch 1), under requests that all complete."""
    import json
    import signal
    import subprocess
    import sys

    import yaml

    from tests.helpers.cluster import wait_all_kv_free
    from tests.helpers.serve_process import serve_process

    config = tmp_path / "tiny.yaml"
    pool = {"replicas": 1, "torch_threads": 1, "kv_blocks": 64, "cpus_per_replica": 0.5}
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"name": str(tiny_llama_path), "max_model_len": 512},
                "pools": {"prefill": pool, "decode": {**pool, "replicas": 2, "kv_blocks": 128}},
            }
        )
    )
    body = {"model": str(tiny_llama_path), "max_tokens": 16, "ignore_eos": True, "temperature": 0.0}

    def complete(prompt: str) -> str:
        response = httpx.post(f"{url}/v1/completions", json={**body, "prompt": prompt}, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    with serve_process(config) as (proc, url):
        before = {p: complete(p) for p in ("one", "two", "three")}
        cli = [sys.executable, "-m", "cli.main", "role", "--url", url, "--worker", "decode-1", "--wait", "--json"]
        load = Load(url, str(tiny_llama_path), max_tokens=64)
        load.start([f"in flight {i}" for i in range(4)])
        out = subprocess.run([*cli, "--to", "prefill"], capture_output=True, text=True, timeout=200)
        assert out.returncode == 0, out.stderr
        answer = json.loads(out.stdout)
        assert answer["switch"]["phase"] == "done", answer
        assert answer["pools"]["prefill"]["workers"] == ["prefill-0", "decode-1"]
        _replayed_alone(load, load.join())
        assert {p: complete(p) for p in before} == before
        status = httpx.get(f"{url}/status", timeout=10).json()
        switched = next(w for w in status["workers"] if w["name"] == "decode-1")
        assert switched["role"] == "prefill" and switched.get("epoch") == 1
        load = Load(url, str(tiny_llama_path), max_tokens=64)
        load.start([f"in flight back {i}" for i in range(4)])
        back = subprocess.run([*cli, "--to", "decode"], capture_output=True, text=True, timeout=200)
        assert back.returncode == 0 and json.loads(back.stdout)["switch"]["phase"] == "done", back.stderr
        _replayed_alone(load, load.join())
        bad = subprocess.run([*cli, "--to", "decode"], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and "HTTP 400" in bad.stderr and "already a decode worker" in bad.stderr
        assert {p: complete(p) for p in before} == before
        wait_all_kv_free(url, timeout_s=20)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


@pytest.mark.e2e  # Ray actors: `make test-e2e`
@pytest.mark.timeout(300)
def test_a_ray_worker_killed_mid_switch_comes_back_in_its_new_role(tiny_llama_path, monkeypatch):
    """The worker's process is SIGKILLed as its rebuild is asked for: its actor is killed for good and a new one is
    started as a prefill worker in its bundle (``RayPools.restart_as``), registered with result "restarted"."""
    import os
    import signal

    import ray

    from cluster.run.launch import start_serving
    from cluster.run.pools import RayPools
    from tests.helpers.cluster import tiny_cluster_config, wait_all_kv_free

    if ray.is_initialized():
        ray.shutdown()
    pool = {"replicas": 1, "torch_threads": 1, "kv_blocks": 64, "cpus_per_replica": 0.5}
    config = tiny_cluster_config(
        tiny_llama_path, router={"port": 0}, pools={"prefill": pool, "decode": {**pool, "replicas": 2}}
    )
    switch_role = RayPools.switch_role
    killed: list[int] = []

    def kill_then_switch(self, record, spec, timeout_s):
        killed.append(record.info["pid"])
        os.kill(record.info["pid"], signal.SIGKILL)
        return switch_role(self, record, spec, timeout_s)

    monkeypatch.setattr(RayPools, "switch_role", kill_then_switch)
    handle = start_serving(config)
    try:
        assert handle.scaler is not None
        answer = handle.scaler.switch_role("decode-1", "prefill", wait=True)
        assert answer["switch"]["phase"] == "restarted", answer
        record = next(r for r in handle.workers if r.name == "decode-1")
        assert record.pool == "prefill" and record.info["role"] == "prefill" and record.info["pid"] != killed[0]
        wait_until(lambda: handle.router.members.workers["decode-1"].role == "prefill", timeout_s=30)
        body = {"model": config.served_model_name, "prompt": "hello", "max_tokens": 4, "ignore_eos": True}
        for _ in range(3):
            served = httpx.post(f"{handle.base_url}/v1/completions", json=body, timeout=60)
            assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 4
        url = handle.base_url
        assert metric_value(url, "pdserve_role_switches_total", None, to="prefill", result="restarted") == 1.0
        wait_all_kv_free(url, timeout_s=20)
    finally:
        handle.stop()


@pytest.mark.e2e  # Ray actors: `make test-e2e`
@pytest.mark.timeout(300)
def test_a_switched_ray_worker_restarted_by_ray_takes_its_new_role_again(tiny_llama_path):
    """Ray restarts a dead actor with the spec it was made with: a decode worker switched to prefill, then SIGKILLed,
    comes back as a decode worker, and the pool monitor switches it to prefill again before it is registered."""
    import os
    import signal

    import ray

    from cluster.run.launch import start_serving
    from tests.helpers.cluster import tiny_cluster_config, wait_all_kv_free

    if ray.is_initialized():
        ray.shutdown()
    pool = {"replicas": 1, "torch_threads": 1, "kv_blocks": 64, "cpus_per_replica": 0.5}
    config = tiny_cluster_config(
        tiny_llama_path, router={"port": 0}, pools={"prefill": pool, "decode": {**pool, "replicas": 2}}
    )
    handle = start_serving(config)
    try:
        assert handle.scaler is not None
        assert handle.scaler.switch_role("decode-1", "prefill", wait=True)["switch"]["phase"] == "done"
        record = next(r for r in handle.workers if r.name == "decode-1")
        pid, address = record.info["pid"], record.info["command_address"]
        os.kill(pid, signal.SIGKILL)

        def back_as_prefill() -> bool:
            view = handle.router.members.workers.get("decode-1")
            fresh = record.info.get("pid") != pid and record.info.get("role") == "prefill"
            return fresh and view is not None and view.alive and view.command_address != address

        wait_until(back_as_prefill, timeout_s=120)
        assert record.pool == "prefill" and handle.router.members.workers["decode-1"].role == "prefill"
        body = {"model": config.served_model_name, "prompt": "hello", "max_tokens": 4, "ignore_eos": True}
        for _ in range(3):
            served = httpx.post(f"{handle.base_url}/v1/completions", json=body, timeout=60)
            assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 4
        wait_all_kv_free(handle.base_url, timeout_s=30)
    finally:
        handle.stop()
