from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from cluster.config import ConfigError, load_config, parse_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name", ["local.yaml", "gpu-node.yaml"])
def test_shipped_serving_configs_load(name):
    config = load_config(CONFIGS / name)
    assert config.pools.prefill.replicas >= 1 and config.pools.decode.replicas >= 1


def test_gpu_node_config_fills_eight_gpus():
    config = load_config(CONFIGS / "gpu-node.yaml")
    pools = config.pools
    assert pools.prefill.replicas * pools.prefill.gpus_per_replica + pools.decode.replicas * pools.decode.gpus_per_replica == 8


def test_cluster_yaml_passes_rays_own_schema():
    import ray.autoscaler

    schema_path = Path(ray.autoscaler.__file__).parent / "ray-schema.json"
    schema = json.loads(schema_path.read_text())
    cluster = yaml.safe_load((CONFIGS / "cluster.yaml").read_text())
    jsonschema.validate(cluster, schema)
    assert any("pdserve" in cmd for cmd in cluster["setup_commands"])


@pytest.mark.parametrize(
    "data, field",
    [
        ({"pools": {"decode": {"replicas": -1}}}, "pools.decode.replicas"),
        ({"pools": {"prefill": {"kv_memory_mb": 0}}}, "pools.prefill.kv_memory_mb"),
        ({"transfer": {"backend": "carrier-pigeon"}}, "transfer.backend"),
        ({"router": {"port": 70000}}, "router.port"),
        ({"mode": "both"}, "mode"),
        ({"routr": {}}, "routr"),
        ({"router": {"policy": "x"}}, "router.policy"),
        ({"pools": {"prefill": {"replicas": 0}}}, "pools"),
    ],
)
def test_bad_values_name_the_file_and_field(tmp_path, data, field):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value) and field in str(info.value)


def test_missing_file_and_non_mapping_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(path)


def test_defaults_are_local_and_safe():
    config = parse_config({})
    assert config.router.host == "127.0.0.1" and config.transfer.failure_policy == "fail"


def test_the_gpu_node_config_needs_an_api_key_to_bind_beyond_loopback():
    from cluster.config import check_network_exposure

    config = load_config(CONFIGS / "gpu-node.yaml")
    with pytest.raises(ConfigError, match="router.host"):
        check_network_exposure(config, config.router.host)
    config.router.api_key = "a-key-from-PDSERVE_API_KEY"  # what `pdserve serve` does with the environment variable
    check_network_exposure(config, config.router.host)
