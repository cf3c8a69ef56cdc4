"""``pdserve bench chaos`` with spare replicas, in-process: killing one worker of each pool under load loses nothing.

Two prefill and two decode workers run as threads (no Ray); at 25 % and 60 % of the requests the busiest decode
worker and then the busiest prefill worker are killed (``WorkerActor.kill``: they stop dead, as a SIGKILL'd process
would). Requests that had no token yet are re-dispatched to the survivors, streams that were mid-generation on the
killed decode worker end with an explicit ``worker_died`` event, none is answered 503, and the survivors hold
nothing afterwards. A prefill worker's death fails no stream that is already decoding on a live decode worker.
"""

from __future__ import annotations

import argparse
import json
import time

import httpx
import pytest
import yaml

from benchmarks import chaos
from cli.main import build_parser

pytestmark = pytest.mark.timeout(180)


def test_cli_takes_the_replica_and_in_process_options():
    args = build_parser().parse_args(
        [
            "bench",
            "chaos",
            "--config",
            "configs/local.yaml",
            "--prefill-replicas",
            "2",
            "--decode-replicas",
            "2",
            "--in-process",
        ]
    )
    assert (args.prefill_replicas, args.decode_replicas, args.in_process) == (2, 2, True)


def test_in_process_chaos_with_spare_replicas_loses_nothing(tiny_llama_path, tmp_path):
    config_path = tmp_path / "chaos.yaml"
    config_path.write_text(
        yaml.safe_dump(
            {
                "model": {"name": str(tiny_llama_path), "max_model_len": 512},
                "pools": {
                    "prefill": {"replicas": 1, "torch_threads": 1, "kv_blocks": 96},
                    "decode": {"replicas": 1, "torch_threads": 1, "kv_blocks": 160},
                },
                "transfer": {"deadline_s": 5, "lease_s": 5},
            }
        )
    )
    args = argparse.Namespace(
        config=str(config_path),
        model=None,
        prefill_replicas=2,
        decode_replicas=2,
        in_process=True,
        num_requests=40,
        concurrency=8,
        max_tokens=48,
        request_timeout_s=30.0,
        kill_decode_at=0.25,
        kill_prefill_at=0.6,
        settle_timeout_s=30.0,
    )
    result = chaos.run(args)
    assert result["replicas"] == {"prefill": 2, "decode": 2} and result["in_process"]
    assert result["requests_sent"] == 40
    assert result["lost"] == 0, result["lost_reasons"]
    assert result["http_503"] == 0, result["failure_reasons"]
    # what may fail: a stream that was mid-generation on the killed decode worker (its KV died with it), or, rarely,
    # one whose KV was still on its way from the killed prefill worker after its first token
    assert set(result["failure_reasons"]) <= {"stream_error:worker_died", "stream_error:kv_transfer_failed"}, result
    assert set(result["worker_died_by"]) <= {result["kills"][0]["worker"]}, result  # the decode worker's, only
    assert result["failure_reasons"].get("stream_error:worker_died", 0) <= result["kills"][0]["inflight"], result
    assert result["completed"] + result["failed_with_explicit_error"] == 40 and result["completed"] > 0
    assert [k["worker"].split("-")[0] for k in result["kills"]] == ["decode", "prefill"]
    assert all(k["detected_after_s"] < 5 for k in result["kills"]), result["kills"]  # missed heartbeats: ~2 s
    assert result["workers_alive_after"] == 2  # the survivors; nothing restarts a thread
    assert result["kv_blocks_held_after"] == 0 and result["requests_held_after"] == 0
    assert result["max_over_deadline_s"] == 0


def test_a_prefill_death_fails_no_stream_already_decoding_elsewhere(tiny_llama_path):
    """Once its first token is out, a request no longer needs its prefill worker: the decode worker has the KV."""
    from cluster.run.launch import start_serving
    from tests.helpers.cluster import tiny_cluster_config

    pools = {
        "prefill": {"replicas": 2, "torch_threads": 1, "kv_blocks": 96},
        "decode": {"replicas": 2, "torch_threads": 1, "kv_blocks": 160},
    }
    config = tiny_cluster_config(tiny_llama_path, pools=pools)
    handle = start_serving(config, in_process=True)
    try:
        for record in handle.workers:  # decode slowly enough that the stream outlives the 2 s heartbeat timeout
            if record.role == "decode":
                engine = record.actor.worker.engine
                engine.step = lambda step=engine.step: (time.sleep(0.02), step())[1]
        body = {
            "model": config.served_model_name,
            "prompt": "tell me a story",
            "max_tokens": 300,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        events: list[str] = []
        with httpx.stream("POST", f"{handle.base_url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                if len(events) == 5:  # decoding on a decode worker: kill the prefill worker that computed the prompt
                    victim = next(iter(handle.router.flows.values())).prefill
                    next(r for r in handle.workers if r.name == victim).actor.kill()
        assert victim not in [w.name for w in handle.router.live("prefill")]  # noticed while the stream ran
        chunks = [json.loads(e) for e in events[:-1]]
        assert events[-1] == "[DONE]" and not [c for c in chunks if "error" in c], chunks[-1]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        status, _ = chaos._settle(handle, timeout_s=15, expected_alive=3)
        assert all(chaos._idle(w) for w in status["workers"] if w["alive"]), status
    finally:
        handle.stop()
