"""`pdserve serve` and `pdserve status` as a user runs them: a real process, a URL, a request, SIGTERM, clean exit.
(`pdserve status` alone, against a scripted router: tests/cli/test_status.py.)"""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import pytest
import yaml

from tests.helpers.serve_process import serve_process

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


@pytest.mark.e2e  # `make test-e2e` (for the suite's 20 minutes): test_ray_cluster.py's loopback test serves and stops on SIGTERM,
# test_shutdown.py's SIGTERM to the group stays
def test_serve_prints_the_url_serves_and_stops_cleanly_on_sigterm(tiny_llama_path, tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"name": str(tiny_llama_path), "max_model_len": 512},
                "pools": {
                    "prefill": {"replicas": 1, "torch_threads": 1, "kv_blocks": 64},
                    "decode": {"replicas": 1, "torch_threads": 1, "kv_blocks": 64},
                },
            }
        )
    )
    with serve_process(config) as (proc, url):
        body = {"model": str(tiny_llama_path), "prompt": "hello", "max_tokens": 4, "ignore_eos": True}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
        status = subprocess.run(
            [sys.executable, "-m", "cli.main", "status", "--url", url], capture_output=True, text=True, timeout=60
        )
        assert status.returncode == 0
        assert "prefill-0" in status.stdout and "decode-0" in status.stdout and "disaggregated" in status.stdout
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert "shutting down" in proc.stdout.read()
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url}/health", timeout=2)
