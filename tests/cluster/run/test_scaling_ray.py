"""Live resizing on Ray when the cluster has no room: the new replica's placement group stays pending (the demand
Ray's autoscaler acts on on a `ray up` cluster), the replica is listed as pending and serves nothing, and scaling
back down removes the pending group and gives its resources back. Local Ray, tiny model."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers.cluster import tiny_cluster_config, wait_all_kv_free

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _group_states() -> dict[str, str]:
    import ray

    return {entry["name"]: entry["state"] for entry in ray.util.placement_group_table().values()}


@pytest.mark.e2e  # `make test-e2e` (for the suite's 20 minutes): Ray's pending placement; scaling itself is test_scaling.py's
def test_a_replica_that_does_not_fit_stays_pending_until_scaled_away(tiny_llama_path, monkeypatch):
    import ray

    import cluster.run.pools
    from cluster.run.launch import start_serving

    if ray.is_initialized():
        ray.shutdown()
    monkeypatch.setattr(cluster.run.pools, "SCALE_UP_WAIT_S", 3.0)  # how long `scale` waits before listing it pending
    # two CPUs per worker, and the local Ray gets exactly what the two pools need: a third worker cannot be placed
    pool = {"replicas": 1, "torch_threads": 1, "kv_blocks": 64, "cpus_per_replica": 2}
    config = tiny_cluster_config(tiny_llama_path, router={"port": 0}, pools={"prefill": pool, "decode": pool})
    handle = start_serving(config)
    try:
        total_cpus = ray.cluster_resources()["CPU"]
        response = httpx.post(
            f"{handle.base_url}/admin/scale",
            json={"pool": "decode", "replicas": 2},
            headers=handle.admin_headers,
            timeout=60,
        )
        assert response.status_code == 200
        decode = response.json()["pools"]["decode"]
        assert decode["pending"] == ["decode-1"] and decode["workers"] == ["decode-0"], decode
        assert _group_states().get("pdserve-decode-1") == "PENDING"
        body = {"model": config.served_model_name, "prompt": "hello", "max_tokens": 4, "ignore_eos": True}
        served = httpx.post(f"{handle.base_url}/v1/completions", json=body, timeout=60)
        assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 4
        status = httpx.get(f"{handle.base_url}/status", timeout=10).json()
        assert [w["name"] for w in status["workers"]] == ["prefill-0", "decode-0"]  # the pending one takes no work

        response = httpx.post(
            f"{handle.base_url}/admin/scale",
            json={"pool": "decode", "replicas": 1},
            headers=handle.admin_headers,
            timeout=60,
        )
        assert response.json()["pools"]["decode"] == {
            "replicas": 1,
            "workers": ["decode-0"],
            "pending": [],
            "draining": [],
            "switching": [],
        }
        assert _group_states().get("pdserve-decode-1") in (None, "REMOVED")
        assert ray.cluster_resources()["CPU"] == total_cpus
        wait_all_kv_free(handle.base_url, timeout_s=15)
    finally:
        handle.stop()
