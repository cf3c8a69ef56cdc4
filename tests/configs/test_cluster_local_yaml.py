"""configs/cluster-local.yaml (``ray up`` with Ray's local provider) and deploy/e2e/serve.yaml agree with the namespace
hosts ``make cluster-e2e`` makes (deploy/e2e/hosts.py), offline: Ray's own preparation and validation accept the
cluster file; its addresses, key and token are the hosts'; the serving config's CPUs land each worker on a host of
its own (hosts are told apart by CPUs), so prefill and decode run on different hosts and a third worker needs the
spare host.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import yaml

from cluster.config import load_config

REPO = Path(__file__).resolve().parents[2]


def _hosts():
    spec = importlib.util.spec_from_file_location("e2e_hosts", REPO / "deploy" / "e2e" / "hosts.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("e2e_hosts", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _cluster() -> dict:
    return yaml.safe_load((REPO / "configs" / "cluster-local.yaml").read_text())


def test_rays_own_preparation_and_validation_accept_it():
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(_cluster())
    validate_config(prepared)
    [node_type] = prepared["available_node_types"].values()
    assert (node_type["min_workers"], node_type["max_workers"]) == (2, 3)  # one spare host for the autoscaler


def test_it_names_the_hosts_key_and_token_the_e2e_script_makes():
    hosts, cluster = _hosts(), _cluster()
    head, *workers = hosts.HOSTS
    assert cluster["provider"]["head_ip"] == head.ip
    assert cluster["provider"]["worker_ips"] == [h.ip for h in workers]
    assert cluster["auth"]["ssh_private_key"] == str(hosts.KEY)
    assert cluster["file_mounts"]["~/.ray/auth_token"] == str(hosts.TOKEN)
    starts = cluster["head_start_ray_commands"] + cluster["worker_start_ray_commands"]
    assert all("RAY_AUTH_MODE=token" in c for c in starts if " start " in c)  # nobody joins without the token
    assert all("--dashboard-host=127.0.0.1" in c for c in cluster["head_start_ray_commands"] if " start " in c)


def test_each_worker_lands_on_a_host_of_its_own_and_a_third_needs_the_spare():
    """The local provider's autoscaler learns a node type's CPUs, never custom resources: hosts are told apart by
    CPUs. The head offers none, each worker host one, each pdserve worker takes one."""
    cluster, config = _cluster(), load_config(REPO / "deploy" / "e2e" / "serve.yaml")
    [head_start] = [c for c in cluster["head_start_ray_commands"] if " start " in c]
    [worker_start] = [c for c in cluster["worker_start_ray_commands"] if " start " in c]
    assert "--num-cpus=0" in head_start and "--num-cpus=$(cat /tmp/pdserve-host-cpus)" in worker_start
    head, w1, w2, w3 = _hosts().HOSTS
    assert (head.cpus, w1.cpus, w2.cpus) == (0, 1, 1) and w3.cpus == 2  # the spare takes a third and a fourth
    assert config.pools.prefill.cpus_per_replica == config.pools.decode.cpus_per_replica == 1
    assert not config.pools.prefill.resources and not config.pools.decode.resources
    assert config.pools.prefill.replicas + config.pools.decode.replicas == cluster["min_workers"]  # the third: spare
    assert config.router.host == _hosts().HOSTS[0].ip and config.router.api_key is None  # key: PDSERVE_API_KEY
    assert config.ray.address == "auto" and config.ray.worker_host == "auto"
