"""Three Ray nodes on one machine: workers land where the placement asks and the KV crosses nodes over zmq tcp."""

from __future__ import annotations

import httpx
import pytest

from cluster.run.launch import start_serving
from tests.helpers.cluster import tiny_cluster_config, wait_all_kv_free

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def three_nodes():
    import ray
    from ray.cluster_utils import Cluster

    from cluster.run.ray_cluster import keep_ray_on_loopback

    keep_ray_on_loopback()  # three "nodes" of this machine, each on 127.0.0.1
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    prefill_node = cluster.add_node(num_cpus=2, resources={"prefill_node": 2})
    decode_node = cluster.add_node(num_cpus=2, resources={"decode_node": 2})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="pdserve-multinode", log_to_driver=False)
    yield cluster, prefill_node.node_id, decode_node.node_id
    ray.shutdown()
    cluster.shutdown()


@pytest.mark.e2e  # `make test-e2e` (for the suite's 20 minutes): KV over TCP is test_transfer_backends.py's; hosts apart, `make cluster-e2e`
def test_pools_land_on_their_nodes_and_kv_crosses_over_tcp(three_nodes, tiny_llama_path):
    _, prefill_node, decode_node = three_nodes
    config = tiny_cluster_config(
        tiny_llama_path,
        # zmq by name: the fake "nodes" share this host's /dev/shm, where the default (auto) would use shared memory
        transfer={"backend": "zmq"},
        pools={
            "prefill": {"replicas": 1, "torch_threads": 1, "kv_blocks": 64, "resources": {"prefill_node": 1}},
            "decode": {
                "replicas": 2,
                "torch_threads": 1,
                "kv_blocks": 64,
                "resources": {"decode_node": 1},
                "placement_strategy": "SPREAD",
            },
        },
    )
    handle = start_serving(config)
    try:
        nodes = {w["name"]: w["node_id"] for w in handle.worker_infos()}
        assert nodes["prefill-0"] == prefill_node
        assert nodes["decode-0"] == nodes["decode-1"] == decode_node
        for info in handle.worker_infos():
            if info["role"] == "decode":
                assert info["kv_address"].startswith("tcp://")
        for i in range(4):
            body = {
                "model": config.served_model_name,
                "prompt": f"hello {i} " * 10,
                "max_tokens": 5,
                "ignore_eos": True,
            }
            response = httpx.post(f"{handle.base_url}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 5
        status = wait_all_kv_free(handle.base_url)
        moved = {w["name"]: (w.get("transfers_ok", 0), w.get("transfer_bytes", 0)) for w in status["workers"]}
        assert moved["prefill-0"][0] == 4 and moved["prefill-0"][1] > 0
        assert sum(moved[f"decode-{i}"][0] for i in range(2)) == 4
    finally:
        handle.stop()
