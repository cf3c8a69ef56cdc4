"""Who can reach a cluster's Ray: a local one listens on loopback only; a joined one must require Ray's token."""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import yaml

from benchmarks.serve_process import process_running
from cluster.config import ConfigError, parse_config
from cluster.run.ray_cluster import LOOPBACK_ENV, check_ray_auth, check_token_file
from tests.helpers.serve_process import serve_process
from tests.helpers.sockets import listening_sockets

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[3]


def _tiny_config_file(tmp_path: Path, model_path: Path) -> Path:
    config = tmp_path / "tiny.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"name": str(model_path), "max_model_len": 512},
                "pools": {
                    "prefill": {"replicas": 1, "torch_threads": 1, "kv_blocks": 64},
                    "decode": {"replicas": 1, "torch_threads": 1, "kv_blocks": 64},
                },
            }
        )
    )
    return config


def _env_without_loopback_rule() -> dict[str, str]:
    """This test process's environment without the rule the suite's own Ray runs under: pdserve must set it."""
    return {k: v for k, v in os.environ.items() if k not in LOOPBACK_ENV}


def test_pdserve_serve_listens_on_loopback_only(tiny_llama_path, tmp_path):
    config = _tiny_config_file(tmp_path, tiny_llama_path)
    with serve_process(config, env=_env_without_loopback_rule()) as (proc, url):
        workers_line = proc.stdout.readline()  # "pdserve: workers: prefill-0 (pid N), decode-0 (pid M)"
        worker_pids = {int(pid) for pid in re.findall(r"\(pid (\d+)\)", workers_line)}
        assert len(worker_pids) == 2, workers_line
        body = {"model": str(tiny_llama_path), "prompt": "hello", "max_tokens": 4, "ignore_eos": True}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200  # the KV went from prefill to decode: the data plane is open
        listeners = listening_sockets(proc.pid)
        # stopped as systemd, docker stop and Kubernetes stop it (the hard case of test_shutdown.py, in make test-e2e):
        # SIGTERM to its whole group, Ray's own processes with it; it exits 0 within 10 s and leaves no worker
        stopping = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0 and time.monotonic() - stopping < 10.0
        time.sleep(0.5)
        assert [pid for pid in worker_pids if process_running(pid)] == []
    # Ray's own servers, both workers and the router's process were all found listening (the check is not empty)
    assert {"gcs_server", "raylet"} <= {listener.process for listener in listeners}
    assert worker_pids | {proc.pid} <= {listener.pid for listener in listeners}
    beyond = [listener for listener in listeners if not listener.loopback]
    assert not beyond, beyond


_RAY_HEAD = """
import os, sys
from cluster.run.ray_cluster import init_local_ray
import ray
init_local_ray(1, "pdserve-auth-test")
print(ray.get_runtime_context().gcs_address, os.environ.get("RAY_AUTH_TOKEN_PATH", ""), flush=True)
sys.stdin.read()  # until the test closes our stdin
ray.shutdown()
"""


@contextmanager
def _ray_head(auth_mode: str) -> Iterator[tuple[str, str]]:
    """A local Ray in a child process with ``RAY_AUTH_MODE=auth_mode``; yields its GCS address and token file."""
    env = {**os.environ, **LOOPBACK_ENV, "RAY_AUTH_MODE": auth_mode}
    proc = subprocess.Popen(
        [sys.executable, "-c", _RAY_HEAD],
        cwd=REPO,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        address, _, token_file = proc.stdout.readline().strip().partition(" ")
        assert address, "the Ray head did not start"
        yield address, token_file
        proc.stdin.close()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def test_joining_a_ray_cluster_without_token_auth_is_refused_with_the_field_to_set(tiny_llama_path, tmp_path):
    config = _tiny_config_file(tmp_path, tiny_llama_path)
    with _ray_head("disabled") as (address, _):
        run = subprocess.run(
            [sys.executable, "-m", "cli.main", "serve", "--config", str(config), "--port", "0", "--address", address],
            cwd=REPO,
            env={**os.environ, **LOOPBACK_ENV},  # this driver's node is the head's: 127.0.0.1
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 2, run.stdout + run.stderr
        assert "ray.allow_unauthenticated" in run.stderr and "RAY_AUTH_MODE=token" in run.stderr
        assert "Traceback" not in run.stderr
        check_ray_auth(parse_config({"ray": {"allow_unauthenticated": True}}), address)  # deliberately: accepted


def test_a_ray_cluster_with_token_auth_is_accepted():
    with _ray_head("token") as (address, _):
        check_ray_auth(parse_config({}), address)


def test_a_local_ray_has_a_token_of_its_own_that_only_its_user_can_read(tmp_path):
    """Not ~/.ray/auth_token (written 0644 by Ray): a file 0600 in a 0700 folder, which the shared default token does
    not open, and which is gone when the head stops."""
    with _ray_head("token") as (address, token_file):
        token = Path(token_file)
        assert stat.S_IMODE(token.stat().st_mode) == 0o600 and stat.S_IMODE(token.parent.stat().st_mode) == 0o700
        other = tmp_path / "someone-elses-token"
        other.write_text("0" * 64)
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
        join = f"import ray; ray.init(address={address!r}); print('joined')"
        refused = subprocess.run(
            [sys.executable, "-c", join],
            # 2 tries, not Ray's 20 a second apart: a wrong token fails every one, a right one joins at the first
            env=env
            | LOOPBACK_ENV
            | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(other), "RAY_NUM_REDIS_GET_RETRIES": "2"},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert "joined" not in refused.stdout and refused.returncode != 0
    assert not token.exists()


def test_joining_with_a_token_file_others_can_read_is_refused_naming_it(tmp_path, monkeypatch):
    token = tmp_path / "auth_token"
    token.write_text("0" * 64)
    token.chmod(0o644)
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    with pytest.raises(ConfigError, match=f"chmod 600 {token}"):
        check_token_file(parse_config({}))
    token.chmod(0o600)
    check_token_file(parse_config({}))


def test_an_address_where_no_ray_answers_is_refused_not_waited_on():
    with pytest.raises(ConfigError, match="could not be checked"):
        check_ray_auth(parse_config({}), "127.0.0.1:9", timeout_s=3.0)
