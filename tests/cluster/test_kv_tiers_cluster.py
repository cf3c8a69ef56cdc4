"""KV tiers in a served cluster: a tiny in-process cluster whose prefill worker's device cache holds three of six
tenants' prefixes, through HTTP. The second round loads every prefix back from the host tier (the same text as the
first round computed), the router learns what the tier holds, and /metrics counts the hits; nothing leaks (the
``serve`` fixture checks every block), and stopping the cluster leaves no shared-memory pool.
"""

from __future__ import annotations

import uuid

import httpx
import pytest

from engine.blocks import prompt_block_hashes
from engine.kv_tiers import host_pool_folder
from tests.helpers.cluster import metric_value, tiny_cluster_config, wait_all_kv_free, wait_until
from tests.helpers.engine import random_prompts

pytestmark = pytest.mark.timeout(300)

BLOCK = 16
PREFIXES = random_prompts(6, 4 * BLOCK, 4 * BLOCK, seed=51)
PROMPTS = [prefix + [9, 8, 7, i] for i, prefix in enumerate(PREFIXES)]


def _complete(handle, prompt: list[int]) -> dict:
    body = {"model": handle.config.served_model_name, "prompt": prompt, "max_tokens": 6, "temperature": 0}
    response = httpx.post(f"{handle.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_second_round_loads_every_prefix_back_from_the_host_tier(tiny_llama_path):
    from cluster.run.launch import start_serving

    pool = f"test-{uuid.uuid4().hex[:8]}"
    offload = {"host_memory_mb": 8, "host_pool": pool}
    pools = {
        "prefill": {"replicas": 1, "torch_threads": 1, "kv_blocks": 12, "kv_offload": offload},
        "decode": {"replicas": 1, "torch_threads": 1, "kv_blocks": 64},
    }
    config = tiny_cluster_config(tiny_llama_path, pools=pools, router={"port": 0, "prefill_policy": "kv_aware"})
    handle = start_serving(config, in_process=True)
    folder = host_pool_folder(pool, bytes(16)).parent
    try:
        first = [_complete(handle, prompt) for prompt in PROMPTS]
        second = [_complete(handle, prompt) for prompt in PROMPTS]
        assert [r["choices"][0]["text"] for r in second] == [r["choices"][0]["text"] for r in first]
        # the device holds three prefixes; cycling through six, each of the second round came from the host tier
        url = handle.base_url
        wait_until(lambda: metric_value(url, "pdserve_worker_total", key="tier_loads") == len(PROMPTS), 10)
        assert metric_value(url, "pdserve_worker_total", key="host_hit_tokens") == len(PROMPTS) * 4 * BLOCK
        assert metric_value(url, "pdserve_worker_total", key="host_saved_bytes") > 0
        assert [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in second] == [4 * BLOCK] * len(PROMPTS)

        # the router knows the host tier's pages: a prefix gone from the device is matched there
        index = handle.router.members.prefix_index
        [prefill] = [w for w in index.workers() if w.startswith("prefill")]
        matched = lambda: index.match_tiers(prompt_block_hashes(PREFIXES[0], BLOCK)).get(prefill)  # noqa: E731
        wait_until(lambda: matched() is not None and matched().host == 4, timeout_s=10)
        assert folder.is_dir()
        wait_all_kv_free(handle.base_url)
    finally:
        handle.stop()
    assert not folder.exists(), "the host pool outlived the cluster"
