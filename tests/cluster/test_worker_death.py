"""Worker processes killed by PID under Ray: explicit errors or transparent retries, rejoin after restart, no leaks."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import threading
import time

import httpx
import pytest
import yaml

from cluster.run.launch import start_serving
from tests.helpers.cluster import metric_value, tiny_cluster_config, wait_all_kv_free, wait_until

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def _pid(handle, name: str) -> int:
    return next(w["pid"] for w in handle.worker_infos() if w["name"] == name)


def test_decode_death_mid_stream_is_an_error_event_then_the_worker_rejoins(ray_local, tiny_llama_path):
    config = tiny_cluster_config(
        tiny_llama_path, pools={"decode": {"replicas": 2, "torch_threads": 1, "kv_blocks": 160}}
    )
    handle = start_serving(config)
    try:
        body = {
            "model": config.served_model_name,
            "prompt": "tell me a long story",
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        }
        lines: list[str] = []
        with httpx.stream("POST", f"{handle.base_url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                lines.append(line)
                if len(lines) == 6:  # a few tokens streamed: kill the decode worker that runs it
                    victim = next(iter(handle.router.flows.values())).decode  # where the router sent it
                    os.kill(_pid(handle, victim), signal.SIGKILL)
                    killed = time.monotonic()
        events = [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "worker_died" and victim in error["message"]
        assert time.monotonic() - killed < 3
        assert victim not in [w.name for w in handle.router.live("decode")]  # no more routing to it
        for _ in range(3):  # served by the survivor meanwhile
            ok = httpx.post(
                f"{handle.base_url}/v1/completions",
                timeout=60,
                json={"model": config.served_model_name, "prompt": "hi", "max_tokens": 3},
            )
            assert ok.status_code == 200
        # restarted, rejoined
        wait_until(lambda: victim in [w.name for w in handle.router.live("decode")], timeout_s=60)
        wait_all_kv_free(handle.base_url, timeout_s=30)
    finally:
        handle.stop()


def _break_the_loop(actor) -> None:
    """Runs inside the worker's process (Ray's ``__ray_call__``): from now on every loop turn raises."""

    def failing_tick() -> None:
        raise RuntimeError("injected: the device is gone")

    actor.worker.role.tick = failing_tick


@pytest.mark.e2e  # `make test-e2e` (for the suite's 20 minutes): Ray's restart of a dead worker is the test above's
def test_a_degraded_worker_is_restarted_by_ray_and_serves_again(ray_local, tiny_llama_path):
    import ray

    config = tiny_cluster_config(tiny_llama_path)
    handle = start_serving(config)
    try:
        old_pid = _pid(handle, "decode-0")
        record = next(r for r in handle.workers if r.name == "decode-0")
        ray.get(record.actor.__ray_call__.remote(_break_the_loop), timeout=30)
        wait_until(lambda: _pid(handle, "decode-0") != old_pid, timeout_s=90)  # the monitor restarted it: a new process
        wait_until(lambda: "decode-0" in [w.name for w in handle.router.live("decode")], timeout_s=60)
        body = {"model": config.served_model_name, "prompt": "hi", "max_tokens": 3, "ignore_eos": True}
        assert httpx.post(f"{handle.base_url}/v1/completions", json=body, timeout=60).status_code == 200
        wait_all_kv_free(handle.base_url, timeout_s=30)
    finally:
        handle.stop()


@pytest.mark.e2e  # long on Ray: `make test-e2e` (the retry logic itself: tests/cluster/routing)
def test_prefill_death_retries_queued_requests_elsewhere(ray_local, tiny_llama_path):
    config = tiny_cluster_config(
        tiny_llama_path,
        pools={
            "prefill": {"replicas": 2, "torch_threads": 1, "kv_blocks": 200, "max_batch_tokens": 8},
            "decode": {"replicas": 1, "torch_threads": 1, "kv_blocks": 300},
        },
        router={"prefill_policy": "round_robin", "port": 0},
        transfer={"deadline_s": 20, "lease_s": 5},
    )
    handle = start_serving(config)
    try:
        victim_pid = _pid(handle, "prefill-0")
        results: list = []

        async def burst():
            async with httpx.AsyncClient(timeout=120) as client:
                body = {"model": config.served_model_name, "max_tokens": 4, "ignore_eos": True}
                tasks = [
                    client.post(f"{handle.base_url}/v1/completions", json={**body, "prompt": f"{i} " + "y" * 480})
                    for i in range(6)
                ]
                results.extend(await asyncio.gather(*tasks))

        load = threading.Thread(target=lambda: asyncio.run(burst()))
        load.start()
        # kill prefill-0 while requests sit in its queue (long prompts, 8-token chunks: it is busy for a while)
        wait_until(
            lambda: any(s.prefill == "prefill-0" for s in list(handle.router.flows.values())),
            timeout_s=30,
            step_s=0.005,
        )
        os.kill(victim_pid, signal.SIGKILL)
        load.join(120)
        assert len(results) == 6
        for response in results:  # each one answered: completed, or an explicit error
            assert response.status_code == 200 or response.json()["error"]["code"], response.text
        assert sum(r.status_code == 200 for r in results) >= 4
        retried = metric_value(handle.base_url, "pdserve_errors_total", reason="retried_after_worker_death")
        assert retried and retried >= 1
        wait_until(lambda: len(handle.router.live("prefill")) == 2, timeout_s=60)
        wait_all_kv_free(handle.base_url, timeout_s=30)
    finally:
        handle.stop()


@pytest.mark.e2e  # the chaos bench on Ray: `make test-e2e` (in-process: tests/benchmarks/test_chaos.py)
def test_chaos_bench_loses_nothing_and_leaks_nothing(ray_local, tiny_llama_path, tmp_path, capsys):
    from benchmarks import chaos

    config_path = tmp_path / "chaos.yaml"
    config_path.write_text(
        yaml.safe_dump(
            {
                "model": {"name": str(tiny_llama_path), "max_model_len": 512},
                "pools": {
                    "prefill": {"replicas": 1, "torch_threads": 1, "kv_blocks": 96},
                    "decode": {"replicas": 1, "torch_threads": 1, "kv_blocks": 160},
                },
                "transfer": {"deadline_s": 10, "lease_s": 10},
            }
        )
    )
    args = argparse.Namespace(
        config=str(config_path),
        model=None,
        num_requests=40,
        concurrency=8,
        max_tokens=12,
        request_timeout_s=30.0,
        kill_decode_at=0.25,
        kill_prefill_at=0.6,
        settle_timeout_s=60.0,
    )
    result = chaos.run(args)
    assert result["requests_sent"] == 40
    assert result["lost"] == 0, result["lost_reasons"]
    assert result["completed"] + result["failed_with_explicit_error"] == 40 and result["completed"] > 0
    assert result["kv_blocks_held_after"] == 0 and result["requests_held_after"] == 0
    assert result["max_over_deadline_s"] == 0
    assert len(result["kills"]) == 2 and all(k["new_pid"] != k["pid"] for k in result["kills"])
    assert result["workers_alive_after"] == 2
