"""Live resizing (cluster/run/scaling.py): pools grow and shrink under load, nothing is lost, no KV is leaked.

In-process clusters (LocalPools, the tiny model): the real router, API, workers and KV transfer, as threads. The
``serve`` fixture checks at teardown that every block is free and no request is held anywhere.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest
import yaml

from tests.helpers.cluster import metric_value, wait_all_kv_free, wait_until
from tests.helpers.serve_process import serve_process

pytestmark = pytest.mark.timeout(120)


@dataclass
class StreamResult:
    text: str = ""
    tokens: int = 0
    finish_reason: str | None = None
    error: dict | None = None
    status: int = 0


@dataclass
class Load:
    """Streamed completions run from threads; each result what its client saw."""

    url: str
    model: str
    max_tokens: int
    results: list[StreamResult] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self, count: int, prompt: str = "tell me a story about") -> None:
        for i in range(count):
            result = StreamResult()
            self.results.append(result)
            thread = threading.Thread(target=self._run, args=(f"{prompt} {i}", result), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _run(self, prompt: str, result: StreamResult) -> None:
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=90) as response:
            result.status = response.status_code
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    result.error = event["error"]
                    continue
                if event.get("usage"):
                    result.tokens = event["usage"]["completion_tokens"]
                for choice in event.get("choices", []):
                    result.text += choice.get("text", "")
                    result.finish_reason = choice.get("finish_reason") or result.finish_reason

    def join(self, timeout_s: float = 90) -> list[StreamResult]:
        for thread in self.threads:
            thread.join(timeout_s)
        assert not any(t.is_alive() for t in self.threads)
        return self.results


def _decode_of_streams(router) -> set[str]:
    try:
        return {s.decode for s in list(router.flows.values()) if s.decode}
    except RuntimeError:  # the dict changed while it was read (another thread): the next look sees it
        return set()


def _streaming_on(router, worker: str) -> bool:
    try:
        return any(s.decode == worker and s.num_output_tokens > 2 for s in list(router.flows.values()))
    except RuntimeError:
        return False


def test_scale_decode_up_under_load_the_new_worker_gets_traffic(serve):
    handle = serve()
    load = Load(handle.base_url, handle.config.served_model_name, max_tokens=24)
    load.start(4)
    wait_until(lambda: len(handle.router.flows) >= 2, timeout_s=20)
    membership = handle.scaler.scale("decode", 2)  # under load: the first wave still streams from decode-0
    assert membership["pools"]["decode"]["workers"] == ["decode-0", "decode-1"]
    assert "decode-1" in handle.router.members.workers  # registered when scale returns: no restart
    seen: set[str] = set()
    sampler_stop = threading.Event()

    def sample() -> None:
        while not sampler_stop.is_set():
            seen.update(_decode_of_streams(handle.router))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    load.start(6, prompt="a second wave")
    results = load.join()
    sampler_stop.set()
    sampler.join(5)
    assert all(r.status == 200 and r.error is None and r.tokens == 24 for r in results), results
    assert "decode-1" in seen  # the new worker took requests
    status = httpx.get(f"{handle.base_url}/status", timeout=5).json()
    assert status["pools"]["decode"] == {
        "replicas": 2,
        "workers": ["decode-0", "decode-1"],
        "draining": [],
        "switching": [],
    }


def test_scale_decode_down_under_load_drains_loses_nothing_and_stops_the_worker(serve):
    handle = serve(pools={"decode": {"replicas": 2, "torch_threads": 1, "kv_blocks": 160}})
    victim = next(r for r in handle.workers if r.name == "decode-1")
    load = Load(handle.base_url, handle.config.served_model_name, max_tokens=160)
    load.start(6)
    wait_until(lambda: _streaming_on(handle.router, "decode-1"), timeout_s=30)
    membership = handle.scaler.scale("decode", 1, drain_timeout_s=60)
    held = [s.rid for s in list(handle.router.flows.values()) if s.decode == "decode-1"]
    assert held  # it still streams requests when its drain begins
    assert membership["pools"]["decode"]["draining"] == ["decode-1"]
    assert handle.router.members.workers["decode-1"].state.value == "draining"
    assert [w.name for w in handle.router.live("decode")] == ["decode-0"]  # nothing new goes to it
    load.start(4, prompt="after the resize")  # these may only land on decode-0
    results = load.join()
    assert all(r.status == 200 and r.error is None and r.tokens == 160 and r.finish_reason == "length" for r in results)
    assert handle.scaler.wait_idle(timeout_s=30)
    # its streams moved to decode-0 (router.migrate_on_drain) rather than finishing there
    assert metric_value(handle.base_url, "pdserve_migrations_total", reason="drain", result="moved") >= 1
    wait_until(lambda: "decode-1" not in handle.router.members.workers, timeout_s=5)
    assert not victim.actor.worker._thread.is_alive()  # drained, then stopped by the pool
    assert [r.name for r in handle.workers if r.pool == "decode"] == ["decode-0"]
    status = wait_all_kv_free(handle.base_url, timeout_s=15)  # survivors hold nothing
    assert [w["name"] for w in status["workers"]] == ["prefill-0", "decode-0"]
    assert status["pools"]["decode"] == {"replicas": 1, "workers": ["decode-0"], "draining": [], "switching": []}


def test_a_request_left_at_the_drain_deadline_gets_an_explicit_error(serve):
    # a drain that waits for its streams (they do not move): the deadline path
    handle = serve(
        pools={"decode": {"replicas": 2, "torch_threads": 1, "kv_blocks": 160}}, router={"migrate_on_drain": False}
    )
    load = Load(handle.base_url, handle.config.served_model_name, max_tokens=400)
    load.start(2)
    wait_until(lambda: _streaming_on(handle.router, "decode-1"), timeout_s=30)
    handle.scaler.scale("decode", 1, drain_timeout_s=0.5)
    results = load.join()
    failed = [r for r in results if r.error is not None]
    assert len(failed) == 1 and "drain deadline" in failed[0].error["message"], results
    assert failed[0].tokens < 400 and failed[0].text  # it had streamed: the error came instead of the rest
    survivor = next(r for r in results if r.error is None)
    assert survivor.tokens == 400 and survivor.finish_reason == "length"
    assert handle.scaler.wait_idle(timeout_s=20)
    wait_until(lambda: "decode-1" not in handle.router.members.workers, timeout_s=5)


def test_admin_scale_route_needs_the_key_and_names_the_bad_field(serve):
    handle = serve(router={"api_key": "sk-scale-test"})
    url, auth = f"{handle.base_url}/admin/scale", {"Authorization": "Bearer sk-scale-test"}
    assert httpx.post(url, json={"pool": "decode", "replicas": 2}, timeout=10).status_code == 401
    for body, param in [
        ({"pool": "router", "replicas": 2}, "pool"),
        ({"replicas": 2}, "pool"),
        ({"pool": "decode", "replicas": -1}, "replicas"),
        ({"pool": "decode", "replicas": "2"}, "replicas"),
        ({"pool": "decode", "replicas": True}, "replicas"),
        ({"pool": "prefill", "replicas": 0}, "replicas"),  # disaggregated mode needs one of each
        ({"pool": "decode", "replicas": 2, "drain_timeout_s": 0}, "drain_timeout_s"),
        ({"pool": "decode", "replicas": 2, "size": 3}, "size"),
    ]:
        response = httpx.post(url, json=body, headers=auth, timeout=10)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, (body, response.text)
    assert [w.name for w in handle.router.live("decode")] == ["decode-0"]  # nothing changed
    response = httpx.post(url, json={"pool": "decode", "replicas": 2}, headers=auth, timeout=60)
    assert response.status_code == 200
    assert response.json()["pools"]["decode"]["workers"] == ["decode-0", "decode-1"]
    response = httpx.post(url, json={"pool": "decode", "replicas": 1}, headers=auth, timeout=60)
    assert response.status_code == 200 and response.json()["pools"]["decode"]["draining"] == ["decode-1"]
    assert handle.scaler.wait_idle(timeout_s=20)
    body = {"model": handle.config.served_model_name, "prompt": "hi", "max_tokens": 3}
    served = httpx.post(f"{handle.base_url}/v1/completions", json=body, headers=auth, timeout=60)
    assert served.status_code == 200


@pytest.mark.e2e  # a `pdserve serve` process on Ray, resized by `pdserve scale`: `make test-e2e`
@pytest.mark.timeout(240)
def test_pdserve_scale_against_a_running_pdserve_serve(tiny_llama_path, tmp_path):
    """The CLI as a user runs it, against `pdserve serve` (Ray): decode 1 -> 2 (a new actor in a placement group
    of its own), then back to 1 with --wait; requests are served throughout."""
    config = tmp_path / "tiny.yaml"
    pool = {"replicas": 1, "torch_threads": 1, "kv_blocks": 64, "cpus_per_replica": 0.5}
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"name": str(tiny_llama_path), "max_model_len": 512},
                "pools": {"prefill": pool, "decode": pool},
            }
        )
    )
    with serve_process(config) as (proc, url):
        cli = [sys.executable, "-m", "cli.main", "scale", "--url", url, "--pool", "decode", "--json"]
        up = subprocess.run([*cli, "--replicas", "2"], capture_output=True, text=True, timeout=120)
        assert up.returncode == 0, up.stderr
        assert json.loads(up.stdout)["pools"]["decode"]["workers"] == ["decode-0", "decode-1"]
        body = {"model": str(tiny_llama_path), "prompt": "hello", "max_tokens": 4, "ignore_eos": True}
        for _ in range(3):
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
        down = subprocess.run([*cli, "--replicas", "1", "--wait"], capture_output=True, text=True, timeout=120)
        assert down.returncode == 0, down.stderr
        status = subprocess.run(
            [sys.executable, "-m", "cli.main", "status", "--url", url], capture_output=True, text=True, timeout=60
        )
        assert "pool decode: 1 replicas" in status.stdout and "decode-1" not in status.stdout, status.stdout
        bad = subprocess.run([*cli, "--replicas", "0"], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and "HTTP 400" in bad.stderr
        wait_all_kv_free(url, timeout_s=20)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


@pytest.mark.e2e  # `make test-e2e` (for the suite's 20 minutes): tests/cluster/run/test_router_processes.py's routers
# hear the monitor
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_with_two_router_processes_every_one_hears_the_resize(tiny_llama_path):
    """``POST /admin/scale`` on whichever router process takes it reaches the main process (which owns the pools),
    and the membership news reaches both processes: each routes to the new worker, then drains and forgets it."""
    from cluster.run.launch import start_serving
    from tests.helpers.cluster import tiny_cluster_config

    config = tiny_cluster_config(tiny_llama_path, router={"port": 0, "processes": 2})
    handle = start_serving(config, in_process=True)
    try:
        url, auth = f"{handle.base_url}/admin/scale", handle.admin_headers
        response = httpx.post(url, json={"pool": "decode", "replicas": 2}, headers=auth, timeout=60)
        assert response.status_code == 200 and response.json()["pools"]["decode"]["replicas"] == 2
        assert httpx.post(url, json={"pool": "decode", "replicas": 0}, headers=auth, timeout=60).status_code == 400

        def every_process(predicate) -> bool:
            statuses = []
            for _ in range(100):  # new connections until both processes have answered
                status = httpx.get(f"{handle.base_url}/status", timeout=5, headers={"Connection": "close"}).json()
                statuses.append(status)
                if len({s["router"]["pid"] for s in statuses}) == 2:
                    break
            return len({s["router"]["pid"] for s in statuses}) == 2 and all(predicate(s) for s in statuses)

        wait_until(lambda: every_process(lambda s: s["pools"]["decode"]["workers"] == ["decode-0", "decode-1"]), 15)
        load = Load(handle.base_url, config.served_model_name, max_tokens=32)
        load.start(6)
        wait_until(lambda: sum(r.tokens > 0 or bool(r.text) for r in load.results) >= 2, timeout_s=30)
        response = httpx.post(
            url, json={"pool": "decode", "replicas": 1, "drain_timeout_s": 60}, headers=auth, timeout=60
        )
        assert response.json()["pools"]["decode"]["draining"] == ["decode-1"]
        results = load.join()
        assert all(r.status == 200 and r.error is None and r.tokens == 32 for r in results), results
        assert handle.scaler.wait_idle(timeout_s=30)
        wait_until(lambda: every_process(lambda s: [w["name"] for w in s["workers"]] == ["prefill-0", "decode-0"]), 15)
        wait_all_kv_free(handle.base_url, timeout_s=15)
    finally:
        handle.stop()
