"""configs/cluster.yaml launches for real, offline: Ray's own config preparation and validation pass on it, nothing
in it is a placeholder but the fields docs/gpu.md tells a user to fill, its GPU node's memory holds what
configs/gpu-node.yaml asks of each GPU, and its setup installs what the head and the GPU nodes need.

No AWS call is made: ``prepare_config`` merges Ray's AWS defaults from the installed package, ``validate_config``
checks Ray's JSON schema and its own rules (the same two steps ``ray up`` runs before it touches the provider).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from cluster.config import MIB, ClusterConfig, load_config, pool_layout

REPO = Path(__file__).resolve().parents[2]
CLUSTER_YAML = REPO / "configs" / "cluster.yaml"
GPU_NODE_YAML = REPO / "configs" / "gpu-node.yaml"
GPU_DOC = REPO / "docs" / "gpu.md"
GIB = 1024**3
TOKEN_FILE = "~/.ray/auth_token"  # Ray's default token path, where `ray get-auth-token --generate` writes it

# Per-GPU memory as nvidia-smi reports it (MiB), and GPUs per instance: AWS's instance pages.
INSTANCE_GPUS = {
    "p5.48xlarge": (8, 81559),  # H100 80GB HBM3
    "p4de.24xlarge": (8, 81920),  # A100-SXM4-80GB
    "p4d.24xlarge": (8, 40960),  # A100-SXM4-40GB: too small for gpu-node.yaml's decode pool
}
# The served model's shape (its config.json): parameters, layers, KV heads, head dim, hidden, intermediate, vocab.
MODELS = {"Meta-Llama-3-8B-Instruct": (8_030_261_248, 32, 8, 128, 4096, 14336, 128256)}
FIXED_OVERHEAD_BYTES = 4 * GIB  # CUDA context, cuBLAS workspaces, captured decode graphs, allocator slack


def _cluster() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def _gpu_node_type(cluster: dict) -> dict:
    gpu_types = [t for t in cluster["available_node_types"].values() if t["resources"].get("GPU")]
    assert len(gpu_types) == 1, "one GPU node type runs gpu-node.yaml"
    return gpu_types[0]


def _strings(value) -> list[str]:
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (*_strings(k), *_strings(v))]
    if isinstance(value, list):
        return [s for item in value for s in _strings(item)]
    return [value] if isinstance(value, str) else []


def pool_bytes_needed(config: ClusterConfig, pool) -> int:
    """What one GPU of ``pool`` holds: bf16 weights, its KV budget, the largest forward's activations and logits (the
    engine's profiling forward), and a fixed overhead."""
    params, _layers, _kv_heads, _head_dim, hidden, intermediate, vocab = MODELS[Path(config.model.name).name]
    dtype_bytes = 4 if config.pool_dtype(pool) == "float32" else 2
    weights = params * dtype_bytes
    kv = ClusterConfig.pool_kv_bytes(pool)
    assert kv is not None, "gpu-node.yaml's pools set kv_memory_mb (the planner and router know their blocks)"
    activations = pool.max_batch_tokens * (2 * intermediate + 4 * hidden) * dtype_bytes
    logits = min(pool.max_num_seqs, pool.max_batch_tokens) * vocab * 4
    return weights + kv + activations + logits + FIXED_OVERHEAD_BYTES


def fits(config: ClusterConfig, instance_type: str) -> dict[str, bool]:
    _gpus, mib = INSTANCE_GPUS[instance_type]
    return {
        name: pool_bytes_needed(config, pool) <= pool.gpu_memory_utilization * mib * MIB
        for name, _, pool in pool_layout(config)
        if pool.replicas and pool.gpus_per_replica > 0
    }


def test_rays_own_preparation_and_validation_accept_it():
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(_cluster())
    validate_config(prepared)
    assert prepared["head_node_type"] == "head"


def test_nothing_is_a_placeholder():
    text = CLUSTER_YAML.read_text()
    values = _strings(_cluster())
    for value in values:
        assert not re.search(r"\bami-[0-9a-f]{8,17}\b", value), (
            f"a hard-coded AMI id (region-specific, goes stale): {value}"
        )
        assert not re.search(r"TODO|XXX|changeme|placeholder|<[^>]+>|your[-_]", value, re.I), value
    for node_type in _cluster()["available_node_types"].values():
        image = node_type["node_config"]["ImageId"]
        # an SSM public parameter EC2 resolves at launch (Ray passes ImageId through unchanged)
        assert image.startswith("resolve:ssm:/aws/service/deeplearning/ami/x86_64/"), image
    assert "TODO" not in text and "XXX" not in text


def test_every_file_mount_is_the_repo_or_a_path_the_user_is_told_to_fill():
    lines = CLUSTER_YAML.read_text().splitlines()
    mounts = _cluster()["file_mounts"]
    doc = GPU_DOC.read_text()
    for remote, local in mounts.items():
        if local == ".":
            assert remote == "/home/ubuntu/pdserve"
            continue
        if local == TOKEN_FILE:
            assert remote == "/home/ubuntu/.ray/auth_token"
            continue
        index = next(i for i, line in enumerate(lines) if line.strip().startswith(f"{remote}:"))
        assert any("FILL" in line for line in lines[max(0, index - 3) : index]), f"{remote}: no FILL note above it"
        assert remote in doc and "file_mounts" in doc, f"docs/gpu.md does not tell the user to fill {remote}"


def test_the_model_folder_is_copied_to_where_gpu_node_yaml_looks():
    config = load_config(GPU_NODE_YAML)
    assert config.model.name in _cluster()["file_mounts"]
    assert Path(config.model.name).name in MODELS


def test_gpu_node_yaml_is_a_valid_pdserve_config_that_fills_the_gpu_node():
    config = load_config(GPU_NODE_YAML)
    node = _gpu_node_type(_cluster())
    layout = [pool for _, _, pool in pool_layout(config) if pool.replicas]
    assert sum(p.replicas * p.gpus_per_replica for p in layout) == node["resources"]["GPU"]
    assert sum(p.replicas * p.cpus_per_replica for p in layout) <= node["resources"]["CPU"]
    gpus, _ = INSTANCE_GPUS[node["node_config"]["InstanceType"]]
    assert node["resources"]["GPU"] == gpus
    assert config.transfer.backend == "nccl" and config.pool_dtype(config.pools.decode) == "bfloat16"
    # eight workers loading 16 GB each, a profiling forward and graph capture: minutes, not Ray's 120 s default
    assert config.ray.start_timeout_s >= 600


def test_the_instance_gpus_hold_what_every_pool_asks():
    config = load_config(GPU_NODE_YAML)
    instance = _gpu_node_type(_cluster())["node_config"]["InstanceType"]
    assert all(fits(config, instance).values()), fits(config, instance)
    assert all(fits(config, "p4de.24xlarge").values())  # the alternative cluster.yaml names


def test_the_memory_check_refuses_the_40gb_a100_the_old_cluster_yaml_named():
    config = load_config(GPU_NODE_YAML)
    assert fits(config, "p4d.24xlarge")["decode"] is False  # 15 GiB weights + 48 GiB KV > 40 GB


@pytest.mark.parametrize("kv_mb, ok", [(49152, True), (80000, False)])
def test_the_memory_check_follows_kv_memory_mb(kv_mb, ok):
    config = load_config(GPU_NODE_YAML)
    config.pools.decode.kv_memory_mb = kv_mb
    assert fits(config, "p5.48xlarge")["decode"] is ok


def test_setup_installs_what_each_node_needs():
    import ray

    cluster = _cluster()
    common = " ".join(cluster["setup_commands"])
    head = " ".join(cluster["head_setup_commands"])
    assert f"'ray[default]=={ray.__version__}'" in common  # the version `ray up` runs: Ray refuses a mix
    assert "boto3" in head  # the head's autoscaler launches the GPU node through the AWS API
    assert re.search(r"download\.pytorch\.org/whl/\$TORCH_INDEX", common) and "TORCH_INDEX=cu13" in common
    torch_at = next(i for i, c in enumerate(cluster["setup_commands"]) if "torch==" in c)
    pdserve_at = next(i for i, c in enumerate(cluster["setup_commands"]) if "-e /home/ubuntu/pdserve" in c)
    assert torch_at < pdserve_at  # else pip resolves pdserve's unpinned torch from PyPI first
    assert any("cuda.is_available" in c for c in cluster["worker_setup_commands"])


def test_every_node_starts_ray_with_token_auth_and_the_one_token():
    cluster = _cluster()
    for command in [*cluster["head_start_ray_commands"], *cluster["worker_start_ray_commands"]]:
        if "ray start" in command:
            assert re.search(r"(^|\s)RAY_AUTH_MODE=token\s.*\bray start\b", command), command
    assert cluster["file_mounts"]["/home/ubuntu/.ray/auth_token"] == TOKEN_FILE  # made once, never in the repo
    assert any("export RAY_AUTH_MODE=token" in c for c in cluster["setup_commands"])  # drivers and `ray exec`
    assert "ray get-auth-token --generate" in CLUSTER_YAML.read_text() and "ray get-auth-token" in GPU_DOC.read_text()
    assert "ray.allow_unauthenticated" in GPU_DOC.read_text()
