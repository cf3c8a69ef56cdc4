from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from cluster.config import ConfigError, load_config, parse_config
from engine.config import SpeculativeConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize(
    "name", ["local.yaml", "local-speculative.yaml", "local-tp.yaml", "gpu-node.yaml", "gpu-node-70b.yaml"]
)
def test_shipped_serving_configs_load(name):
    config = load_config(CONFIGS / name)
    assert config.mode == "disaggregated"
    assert config.pools.prefill.replicas >= 1 and config.pools.decode.replicas >= 1
    if name == "local-tp.yaml":  # prefill over 3 ranks, decode on 1
        assert (config.pools.prefill.tensor_parallel_size, config.pools.decode.tensor_parallel_size) == (3, 1)


@pytest.mark.parametrize("name", ["gpu-node.yaml", "gpu-node-70b.yaml"])
def test_gpu_node_configs_fill_eight_gpus(name):
    pools = load_config(CONFIGS / name).pools
    gpus = [pool.replicas * pool.gpus_per_replica * pool.tensor_parallel_size for pool in (pools.prefill, pools.decode)]
    assert sum(gpus) == 8


def test_the_70b_config_keeps_each_rank_under_its_planned_kv():
    """Its kv_memory_mb per rank stays under what `pdserve plan kv` leaves a GPU of 80 GB at that degree."""
    from planner.kv_sizing import load_shape, size_kv

    config = load_config(CONFIGS / "gpu-node-70b.yaml")
    for pool in (config.pools.prefill, config.pools.decode):
        sizing = size_kv(load_shape("llama-3.1-70b"), "bf16", 16, 80, tensor_parallel_size=pool.tensor_parallel_size)
        assert sizing.weights_fit and 0 < pool.kv_memory_mb * (1 << 20) < sizing.kv_budget_bytes


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
        ({"pools": {"decode": {"speculative": {"num_tokens": 0}}}}, "pools.decode.speculative"),
        ({"pools": {"decode": {"speculative": {"method": "medusa"}}}}, "pools.decode.speculative.method"),
        ({"pools": {"prefill": {"speculative": {}}}}, "pools.prefill.speculative"),
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
    from cluster.network_exposure import check_network_exposure

    config = load_config(CONFIGS / "gpu-node.yaml")
    with pytest.raises(ConfigError, match="router.host"):
        check_network_exposure(config, config.router.host)
    config.router.api_key = "a-key-from-PDSERVE_API_KEY"  # what `pdserve serve` does with the environment variable
    check_network_exposure(config, config.router.host)


def test_a_shipped_config_loads_by_name_from_any_working_directory(tmp_path):
    """configs/ is package data: `pdserve serve --config local` works wherever it runs, not only in the source tree."""
    from cluster.config import find_config

    assert load_config("local") == load_config("local.yaml") == load_config(CONFIGS / "local.yaml")
    assert find_config("gpu-node").name == "gpu-node.yaml"
    repo = Path(__file__).resolve().parents[2]
    code = (
        "import json; from cluster.config import load_config; c = load_config('local'); "
        "print(json.dumps([c.mode, c.pools.decode.kv_memory_mb, c.transfer.backend]))"
    )
    env = {**os.environ, "PYTHONPATH": str(repo)}  # importable, but nothing relative to the working directory
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    shipped = load_config(CONFIGS / "local.yaml")
    assert json.loads(out.stdout) == [shipped.mode, shipped.pools.decode.kv_memory_mb, shipped.transfer.backend]


def test_a_file_path_wins_and_an_unknown_name_lists_the_shipped_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "local").write_text(yaml.safe_dump({"router": {"port": 9123}}))
    assert load_config("local").router.port == 9123  # a file of that name here is what the user meant
    with pytest.raises(ConfigError, match="not found") as info:
        load_config("no-such-config")
    assert "local.yaml" in str(info.value) and "gpu-node.yaml" in str(info.value)


def test_unstreamed_kv_from_a_tensor_parallel_prefill_pool_is_an_error_naming_stream_layers():
    pools = {"prefill": {"tensor_parallel_size": 3}}
    with pytest.raises(ConfigError, match=r"transfer\.stream_layers: false cannot hold with pools\.prefill\.tensor_"):
        parse_config({"transfer": {"stream_layers": False}, "pools": pools})
    assert parse_config({"transfer": {"stream_layers": True}, "pools": pools}).transfer.stream_layers
    assert not parse_config(
        {"mode": "colocated", "transfer": {"stream_layers": False}, "pools": pools}
    ).transfer.stream_layers


def test_nccl_on_a_cpu_pool_is_an_error_naming_transfer_backend():
    gpus = {"prefill": {"gpus_per_replica": 1}, "decode": {"gpus_per_replica": 1}}
    with pytest.raises(ConfigError, match=r"transfer\.backend.*pools\.prefill and pools\.decode.*gloo"):
        parse_config({"transfer": {"backend": "nccl"}})
    with pytest.raises(ConfigError, match=r"transfer\.backend.*pools\.decode has gpus_per_replica: 0"):
        parse_config({"transfer": {"backend": "nccl"}, "pools": {"prefill": gpus["prefill"]}})
    assert parse_config({"transfer": {"backend": "nccl"}, "pools": gpus}).transfer.backend == "nccl"
    assert parse_config({"transfer": {"backend": "gloo"}}).transfer.backend == "gloo"  # the same code on the CPU
    # colocated workers move no KV: the backend is not used, so it is not an error
    assert parse_config({"mode": "colocated", "transfer": {"backend": "nccl"}}).mode == "colocated"
    config = parse_config({})
    config.transfer.backend = "nccl"  # an assignment skips the cross-section check; building the workers does not
    with pytest.raises(ConfigError, match=r"transfer\.backend"):
        config.worker_specs("/model", ["tcp://127.0.0.1:1"], "127.0.0.1")


def test_one_set_of_defaults():
    """The config's defaults are the engine's, the transfer layer's and the worker runtime's own (lease 30 s)."""
    from engine.config import EngineConfig
    from transfer.config import TransferConfig
    from worker.spec import RuntimeOptions, WorkerSpec

    config = parse_config({})
    transfer = config.transfer_config()
    assert transfer.lease_s == TransferConfig().lease_s == config.transfer.lease_s == 30.0
    assert transfer.deadline_s == TransferConfig().deadline_s == config.transfer.deadline_s
    assert transfer.kv_wire_dtype == TransferConfig().kv_wire_dtype
    engine = config.engine_config(config.pools.decode, "/model")
    assert engine == EngineConfig(model="/model", max_model_len=None)  # every engine default untouched
    spec_defaults = WorkerSpec("w", "decode", EngineConfig(), RuntimeOptions(["tcp://127.0.0.1:1"]))
    specs = config.worker_specs("/model", ["tcp://127.0.0.1:1"], "127.0.0.1")
    for spec in specs:
        assert spec.transfer_backend == spec_defaults.transfer_backend
        assert spec.failure_policy == spec_defaults.failure_policy
        assert spec.zmq_transport == spec_defaults.zmq_transport
        assert spec.runtime.orphan_timeout_s == RuntimeOptions(["x"]).orphan_timeout_s
        assert spec.runtime.stats_interval_s == RuntimeOptions(["x"]).stats_interval_s


def test_worker_specs_carry_every_setting_of_the_config():
    config = load_config(CONFIGS / "gpu-node.yaml")
    config.router.api_key = "k" * 32
    config.transfer.secret = "s" * 32
    config.transfer.failure_policy = "recompute"
    config.pools.decode.reserve_headroom_tokens = 64
    config.pools.decode.speculative = SpeculativeConfig(num_tokens=3, ngram_max=2)
    specs = config.worker_specs("/models/llama", ["tcp://10.0.0.1:5000", "tcp://10.0.0.1:5001"], "auto")
    assert [s.name for s in specs] == [f"prefill-{i}" for i in range(2)] + [f"decode-{i}" for i in range(6)]
    assert [s.role.value for s in specs] == ["prefill"] * 2 + ["decode"] * 6
    assert [s.pool for s in specs] == ["prefill"] * 2 + ["decode"] * 6
    decode = specs[-1]
    pool = config.pools.decode
    assert decode.gpus == pool.gpus_per_replica == 1
    assert decode.engine.model == "/models/llama" and decode.engine.dtype == "bfloat16"
    assert decode.engine.kv_cache_memory_bytes == pool.kv_memory_mb * 1024 * 1024
    assert (decode.engine.max_batch_tokens, decode.engine.max_num_seqs) == (pool.max_batch_tokens, pool.max_num_seqs)
    assert decode.engine.max_model_len == 8192 and decode.engine.block_size == config.transfer.block_size
    assert decode.engine.device == "cpu"  # not decided here: each worker resolves its own (worker.spec)
    assert decode.transfer_backend == "nccl" and decode.transfer.lease_s == 60 and decode.transfer.deadline_s == 30
    assert decode.failure_policy == "recompute" and decode.reserve_headroom_tokens == 64
    assert decode.engine.speculative == SpeculativeConfig(num_tokens=3, ngram_max=2)
    assert decode.runtime.secret == decode.transfer.secret == "s" * 32
    assert decode.runtime.router_addresses == ["tcp://10.0.0.1:5000", "tcp://10.0.0.1:5001"]
    assert decode.runtime.host == "auto" and decode.runtime.orphan_timeout_s == config.router.orphan_timeout_s
    assert specs[0].engine.max_batch_tokens == config.pools.prefill.max_batch_tokens
    assert specs[0].engine is not specs[1].engine  # no shared mutable parts between workers
    colocated = parse_config({"mode": "colocated", "pools": {"decode": {"replicas": 2}}})
    assert [(s.name, s.role.value) for s in colocated.worker_specs("/m", ["tcp://127.0.0.1:1"], "127.0.0.1")] == [
        ("prefill-0", "colocated"),
        ("decode-0", "colocated"),
        ("decode-1", "colocated"),
    ]
