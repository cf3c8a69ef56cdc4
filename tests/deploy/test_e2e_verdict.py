"""``make cluster-e2e``'s verdict (deploy/e2e/verdict.py): the summary's ``ok`` is the conjunction of its parts, so
a part that failed (a KV-path check's ``ok: false``) fails the run."""

from __future__ import annotations

import importlib.util
from pathlib import Path

VERDICT = Path(__file__).resolve().parents[2] / "deploy" / "e2e" / "verdict.py"
_spec = importlib.util.spec_from_file_location("e2e_verdict", VERDICT)
assert _spec is not None and _spec.loader is not None
verdict = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(verdict)

PASSING = {
    "openai_client": {"completion_tokens": 16, "ok": True},
    "greedy_vs_transformers": {"tokens": 32, "equal": True},
    "auth": {"ok": True},
    "faults": {
        "delay_10ms": {"skipped": "no netem"},
        "loss_1pct": {"sent": 90, "completed": 88, "failed": 2, "lost": 0, "bench_exit": 0,
                      "kv_held_after": {"inflight": 0, "decode_blocks_held": 0}},
    },
    "kv_paths_by_host_pair": {"pairs": [], "ok": True},
}  # fmt: skip


def test_a_summary_whose_parts_all_pass_is_ok():
    assert verdict.failed_parts(PASSING) == []


def test_a_summary_fails_on_its_kv_path_check():
    summary = {**PASSING, "kv_paths_by_host_pair": {"pairs": [{"path": "shm-direct"}], "ok": False}}
    assert verdict.failed_parts(summary) == ["kv_paths_by_host_pair.ok"]


def test_lost_requests_held_kv_unequal_tokens_and_a_raised_step_each_fail_it():
    fault = {**PASSING["faults"]["loss_1pct"], "lost": 1, "kv_held_after": {"inflight": 0, "decode_blocks_held": 3}}
    summary = {
        **PASSING,
        "error": "TimeoutError: pdserve /health",
        "greedy_vs_transformers": {"tokens": 32, "equal": False},
        "faults": {"loss_1pct": fault},
    }
    assert verdict.failed_parts(summary) == [
        "error",
        "greedy_vs_transformers.equal",
        "faults.loss_1pct.lost",
        "faults.loss_1pct.kv_held_after",
    ]
