"""What ``pdserve bench routing`` reads from the cluster around a run, and the figures it makes of it.

``benchmarks/routing_bench.py`` starts the clusters and drives the load; this module turns what a cluster reports into
JSON. Around each run it takes the router's Prometheus samples (``/metrics``) and, once every worker is idle in a
fresh heartbeat, its ``/status``; ``run_figures`` makes one run's figures from the load tester's summary and the
counters' deltas (KV bytes, prefix hit rates, routing decisions, what is still held), ``compare`` the kv_aware /
baseline ratios and the goal (TTFT p50 ratio <= ``GOAL_TTFT_P50_RATIO``).
"""

from __future__ import annotations

import time
from typing import Any

import httpx

GOAL_TTFT_P50_RATIO = 0.5

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def router_samples(base_url: str) -> Samples:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def settle(base_url: str, timeout_s: float = 30.0) -> dict:
    """``/status`` once every worker is idle with nothing held, in a heartbeat sent after this call began (worker
    counters travel in heartbeats); ``settled`` False if not within ``timeout_s``."""
    started = time.monotonic()
    status: dict = {"workers": [], "inflight": None}
    while time.monotonic() - started < timeout_s:
        status = httpx.get(f"{base_url}/status", timeout=10).json()
        workers = [w for w in status["workers"] if w["alive"]]
        fresh = all(w.get("stats_age_s") is not None and w["stats_age_s"] < time.monotonic() - started for w in workers)
        idle = all(
            w.get("requests", 0) == 0
            and w.get("awaiting_kv", 0) == 0
            and w.get("leased_transfers", 0) == 0
            and w.get("free_blocks") == w.get("total_blocks")
            for w in workers
        )
        if workers and fresh and idle and status["inflight"] == 0:
            return status | {"settled": True}
        time.sleep(0.1)
    return status | {"settled": False}


def worker_total(status: dict, role: str, key: str) -> int:
    return int(worker_sum(status, role, key))


def worker_sum(status: dict, role: str, key: str) -> float:
    """A heartbeat counter summed over the role's workers in ``/status`` (some are seconds, not counts)."""
    return sum(w.get(key, 0) or 0 for w in status["workers"] if w["role"] == role)


def ratio(num: float | None, den: float | None) -> float | None:
    return round(num / den, 4) if num is not None and den else None


def _ms(described: dict, key: str) -> float | None:
    value = described.get(key)
    return None if value is None else round(value, 1)


def run_figures(summary: dict, before: tuple[Samples, dict], after: tuple[Samples, dict]) -> dict[str, Any]:
    (m0, s0), (m1, s1) = before, after

    def delta(name: str, **labels: str) -> int:
        return int(sample(m1, name, **labels) - sample(m0, name, **labels))

    def worker_delta(role: str, key: str) -> int:
        return worker_total(s1, role, key) - worker_total(s0, role, key)

    completed = summary["completed"]
    received = worker_delta("decode", "transfer_bytes")
    routed = delta("pdserve_routed_prompt_tokens_total", pool="prefill")
    matched = delta("pdserve_prefix_matched_tokens_total", pool="prefill")
    reserved = delta("pdserve_routed_prompt_tokens_total", pool="decode")
    cached = delta("pdserve_decode_cached_prompt_tokens_total")
    out: dict[str, Any] = {
        "requests": summary["requests"],
        "completed": completed,
        "failed": summary["failed"],
        "failures": summary["failures"],
        "duration_s": round(summary["duration_s"], 2),
        "ttft_ms": {"p50": _ms(summary["ttft_ms"], "p50"), "p90": _ms(summary["ttft_ms"], "p90")},
        "tpot_ms": {"p50": _ms(summary["tpot_ms"], "p50")},
        "kv_bytes": {
            "received_by_decode": received,
            "sent_by_prefill": worker_delta("prefill", "transfer_bytes"),
            "per_request": round(received / completed) if completed else None,
        },
        "prefix_hit_rate": {"prefill_router": ratio(matched, routed), "decode": ratio(cached, reserved)},
        "router": {
            "prefill_routed_prompt_tokens": routed,
            "prefill_prefix_matched_tokens": matched,
            "decode_reserved_prompt_tokens": reserved,
            "decode_cached_prompt_tokens": cached,
            "prefill_decisions": {
                r: delta("pdserve_routing_decisions_total", pool="prefill", reason=r) for r in ("prefix", "load")
            },
            "prefill_path": {p: delta("pdserve_prefill_path_total", path=p) for p in ("remote", "local")},
        },
        "engine_prefix_hit_tokens": {
            "prefill": worker_delta("prefill", "prefix_hit_tokens"),
            "decode": worker_delta("decode", "prefix_hit_tokens"),
        },
        "held_after": {
            "settled": s1["settled"],
            "kv_blocks": sum((w.get("total_blocks") or 0) - (w.get("free_blocks") or 0) for w in s1["workers"]),
            "requests": sum(w.get("requests", 0) or 0 for w in s1["workers"]) + (s1.get("inflight") or 0),
        },
    }
    turns = summary.get("multi_turn")
    if turns:
        first, later = turns["ttft_ms_first_turn"], turns["ttft_ms_later_turns"]
        out["turns"] = {
            "conversations_completed": turns["completed"],
            "ttft_ms_first_turn": {"p50": _ms(first, "p50"), "p90": _ms(first, "p90")},
            "ttft_ms_later_turns": {"p50": _ms(later, "p50"), "p90": _ms(later, "p90")},
            "ttft_ms_p50_by_turn": {k: _ms(v["ttft_ms"], "p50") for k, v in turns["by_turn"].items()},
            "input_tokens_mean_by_turn": {
                k: None if v["input_tokens_mean"] is None else round(v["input_tokens_mean"], 1)
                for k, v in turns["by_turn"].items()
            },
        }
    return out


def compare(runs: dict[str, dict]) -> dict[str, Any]:
    base, new = runs["baseline"], runs["kv_aware"]
    ratios = {
        "ttft_p50": ratio(new["ttft_ms"]["p50"], base["ttft_ms"]["p50"]),
        "ttft_p90": ratio(new["ttft_ms"]["p90"], base["ttft_ms"]["p90"]),
        "kv_bytes_per_request": ratio(new["kv_bytes"]["per_request"], base["kv_bytes"]["per_request"]),
    }
    if "turns" in new:
        ratios["ttft_p50_later_turns"] = ratio(
            new["turns"]["ttft_ms_later_turns"]["p50"], base["turns"]["ttft_ms_later_turns"]["p50"]
        )
    met = ratios["ttft_p50"] is not None and ratios["ttft_p50"] <= GOAL_TTFT_P50_RATIO
    return {"ratios": ratios, "goal": {"ttft_p50_ratio_at_most": GOAL_TTFT_P50_RATIO, "met": met}}
