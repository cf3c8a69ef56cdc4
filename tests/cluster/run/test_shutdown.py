"""`pdserve serve` stops the way process managers stop it: SIGINT, SIGTERM to the process, SIGTERM to its group.

systemd, `docker stop` and Kubernetes signal the whole process group, which kills Ray's own processes (raylet, GCS)
at the same moment as `pdserve serve`; a shutdown that then waits on Ray hangs for minutes and orphans the workers.
Each case must exit 0 within 10 s and leave none of the worker processes it reported.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import yaml

from benchmarks.serve_process import process_running

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


# make test-e2e (the suite's 20 minutes); make test stops its loopback test's `pdserve serve` by SIGTERM to the group,
# the hard case, with the same checks (tests/cluster/run/test_ray_cluster.py)
@pytest.mark.e2e
@pytest.mark.parametrize("how", ["sigint", "sigterm", "sigterm_group"])
def test_serve_exits_within_10s_and_leaves_no_worker(how, tiny_llama_path, tmp_path):
    import ray

    if ray.is_initialized():
        ray.shutdown()
    config = tmp_path / "tiny.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"name": str(tiny_llama_path), "max_model_len": 256},
                "pools": {
                    "prefill": {"replicas": 1, "torch_threads": 1, "kv_blocks": 32},
                    "decode": {"replicas": 1, "torch_threads": 1, "kv_blocks": 32},
                },
            }
        )
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "serve", "--config", str(config), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    pids: list[int] = []
    try:
        seen, deadline = [], time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            seen.append(line)
            if "workers:" in line:
                pids = [int(p) for p in re.findall(r"pid (\d+)", line)]
            if "to stop" in line or (not line and proc.poll() is not None):
                break
        assert len(pids) == 2 and all(process_running(p) for p in pids), "".join(seen)
        started = time.monotonic()
        if how == "sigint":
            proc.send_signal(signal.SIGINT)
        elif how == "sigterm":
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGTERM)  # what systemd, docker stop and Kubernetes do
        assert proc.wait(timeout=15) == 0
        assert time.monotonic() - started < 10.0
        time.sleep(0.5)
        assert [p for p in pids if process_running(p)] == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        for pid in pids:  # worker processes this test started, by their PIDs
            if process_running(pid):
                os.kill(pid, signal.SIGKILL)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # Ray's processes left in the group this test created
        except OSError:
            pass
