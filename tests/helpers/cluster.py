"""Cluster test helpers: a tiny cluster's config, polling, the workers' KV state and ``/metrics`` samples."""

from __future__ import annotations

import time

import httpx

from cluster.config import ClusterConfig, parse_config


def tiny_cluster_config(model_path, mode: str = "disaggregated", **sections) -> ClusterConfig:
    data = {
        "model": {"name": str(model_path), "max_model_len": 512},
        "mode": mode,
        "pools": {
            "prefill": {"replicas": 1, "torch_threads": 1, "kv_blocks": 96},
            "decode": {"replicas": 1, "torch_threads": 1, "kv_blocks": 160},
        },
        "router": {"port": 0},
        "transfer": {"deadline_s": 20, "lease_s": 20},
    }
    for key, value in sections.items():
        if isinstance(value, dict):
            data.setdefault(key, {}).update(value)
        else:
            data[key] = value
    return parse_config(data)


def _auth(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def wait_until(predicate, timeout_s: float, step_s: float = 0.05) -> float:
    """Poll ``predicate`` until it holds; the seconds it took (AssertionError after ``timeout_s``)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if predicate():
            return time.monotonic() - started
        time.sleep(step_s)
    raise AssertionError("condition not reached in time")


def worker_named(handle, name: str):
    """The worker object of an in-process cluster, by name (faults are injected into it)."""
    return next(r.actor.worker for r in handle.workers if r.name == name)


def wait_all_kv_free(base_url: str, timeout_s: float = 10.0, api_key: str | None = None) -> dict:
    """Every worker reports all blocks free and nothing held, in a heartbeat sent after this call began (an
    earlier one may predate the requests' end; a run faster than the first heartbeat has no figures yet)."""
    started = time.monotonic()
    deadline = started + timeout_s
    status: dict = {}
    while time.monotonic() < deadline:
        status = httpx.get(f"{base_url}/status", headers=_auth(api_key), timeout=5).json()
        fresh = all(
            w.get("stats_age_s") is not None and w["stats_age_s"] < time.monotonic() - started
            for w in status["workers"]
            if w["alive"]
        )
        if (
            fresh
            and all(
                w.get("free_blocks") == w.get("total_blocks")
                and w.get("requests", 0) == 0
                and w.get("awaiting_kv", 0) == 0
                and w.get("leased_transfers", 0) == 0
                for w in status["workers"]
            )
            and status["inflight"] == 0
        ):
            return status
        time.sleep(0.1)
    raise AssertionError(f"KV blocks or requests still held: {status}")


def metric_value(base_url: str, name: str, api_key: str | None = None, **labels: str) -> float | None:
    """One sample from /metrics, parsed with prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base_url}/metrics", headers=_auth(api_key), timeout=5).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None
