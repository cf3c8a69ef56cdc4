"""``pdserve bench role-shift`` on a tiny in-process cluster and small traces of both public formats written here:
the shifting trace is built (a prefill-heavy window, then a decode-heavy one), each way is served with nothing lost
and no KV held after, and the figures and ratios are there (the goal is a measurement on a real model, not asserted)."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks import role_shift_bench
from tests.helpers.cluster import tiny_cluster_config

pytestmark = pytest.mark.timeout(300)


def _traces(folder) -> None:
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lines += [f"2023-11-16 18:15:{i:02d}.000000,{400 + 10 * i},{4 + i % 3}" for i in range(30)]
    (folder / "AzureLLMInferenceTrace_code.csv").write_text("\n".join(lines) + "\n")
    rows = [
        {"timestamp": 100 * i, "input_length": 3000 + i, "output_length": 40 + i, "hash_ids": [i] * 6}
        for i in range(30)
    ]
    (folder / "mooncake_conversation_trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.e2e  # `make test-e2e` (for the suite's 20 minutes): a whole benchmark run; the switch itself is tests/cluster/run/test_role_switch.py's
def test_the_shifting_trace_is_served_every_way(tiny_llama_path, tmp_path) -> None:
    _traces(tmp_path)
    parser = argparse.ArgumentParser()
    role_shift_bench.add_arguments(parser)
    argv = ["--in-process", "--traces", str(tmp_path), "--window-s", "4", "--code-rate", "2", "--chat-rate", "2"]
    args = parser.parse_args(argv + ["--chat-input-scale", "0.01", "--interval-s", "1", "--cooldown-s", "1"])
    args.cluster_config = tiny_cluster_config(tiny_llama_path)
    args.tokenizer = str(tiny_llama_path)
    out = role_shift_bench.run(args)

    code, chat = out["windows"]["code"], out["windows"]["conversation"]
    assert code["rows"] == chat["rows"] == 8 and chat["starts_s"] == 4.0
    assert (
        code["mean_input_tokens"] > chat["mean_input_tokens"]
        and chat["mean_output_tokens"] > code["mean_output_tokens"]
    )
    assert set(out["runs"]) == {"fixed", "restarts", "switches"}
    for way, run in out["runs"].items():
        assert run["requests"] == 16 and run["failed"] == 0 and run["kv_free_after"], (way, run)
        assert run["goodput_rps"] is not None
    assert out["runs"]["fixed"]["moves"] == [] and out["goodput_over_fixed"]["fixed"] == 1.0
    assert out["goals"]["lost_requests"] == 0 and "cores" in out["cpu"]
