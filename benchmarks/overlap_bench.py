"""Overlap benchmark: how much of the KV transfer layer-wise streaming hides behind the prefill, and what the int8
wire does to greedy outputs.

**Overlap.** The served cluster (Ray, one prefill and one decode worker) runs streamed (each layer's KV leaves when its
forward ends) and unstreamed: ``--reps`` greedy requests one at a time after a warm-up, each a distinct random prompt
(no prefix-cache hit). ``kv_after_prefill_s`` (same-host stamps from the prefill step's end to the decode worker
having the whole KV) is the transfer *not* hidden; ``hidden_fraction = 1 - median(streamed) / median(unstreamed)``.

**int8 wire.** ``--int8-check``: N chat prompts x T greedy tokens with ``kv_wire_dtype`` raw, then int8 (a third
cluster); the first differing token is found by re-tokenizing both texts. Wire bytes: the decode worker's
``transfer_bytes`` (GET /status).

    python -m benchmarks.overlap_bench [--int8-check] [--no-overlap]  # prints one JSON object
    pdserve bench overlap [--int8-check] [--json]                     # the same
    pdserve bench transfer --overlap --json        # the transfer bench, these figures under "overlap" (int8 check on)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

# the options, declared once for this and for `pdserve bench transfer --overlap` (there as --overlap-*)
from bench.options import add_overlap_arguments as add_arguments
from benchmarks.options import main

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for sleeping better.",
    "Explain photosynthesis in simple terms.",
    "Write a haiku about the ocean.",
    "How do I boil an egg?",
    "What is the difference between weather and climate?",
    "Why is the sky blue?",
    "Suggest a name for a small coffee shop.",
    "How many legs does a spider have?",
    "What should I pack for a weekend hiking trip?",
    "Summarize the story of Romeo and Juliet in two sentences.",
    "What is a prime number? Give an example.",
    "How can I improve my handwriting?",
    "Translate 'good morning' into Spanish and German.",
    "What are the main causes of inflation?",
    "Describe a cat to someone who has never seen one.",
    "What is the boiling point of water at sea level?",
    "Give me a simple recipe for pancakes.",
    "Why do leaves change colour in autumn?",
    "What is the Python programming language used for?",
]


# ---- helpers --------------------------------------------------------------------------------------------------------


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _ordinary_ids(tokenizer, model_path: str) -> list[int]:
    """Token ids that are not special tokens (and exist in the model's embedding table)."""
    from transformers import AutoConfig

    vocab = min(len(tokenizer), AutoConfig.from_pretrained(model_path).vocab_size)
    special = set(tokenizer.all_special_ids or [])
    return [i for i in range(vocab) if i not in special]


def _random_prompt(ids: list[int], n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.choice(ids) for _ in range(n)]


def _decode_transfer_bytes(base_url: str) -> int:
    import httpx

    status = httpx.get(f"{base_url}/status", timeout=10).json()
    return int(sum(w.get("transfer_bytes", 0) or 0 for w in status["workers"] if w.get("role") == "decode"))


def _wait_stats_settle(base_url: str, timeout_s: float = 3.0) -> int:
    """The counters come from heartbeats (every ~0.2 s): read until two reads agree."""
    deadline = time.monotonic() + timeout_s
    last = _decode_transfer_bytes(base_url)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = _decode_transfer_bytes(base_url)
        if now == last:
            return now
        last = now
    return last


def _complete(base_url: str, model: str, prompt: list[int], max_tokens: int, timeout_s: float = 300) -> dict:
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=timeout_s)
    response.raise_for_status()
    return response.json()


def _chat(base_url: str, model: str, text: str, max_tokens: int, timeout_s: float = 300) -> str:
    import httpx

    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=timeout_s)
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"]


# ---- the measurements -----------------------------------------------------------------------------------------------


def _overlap_run(
    handle, config, ids: list[int], prompt_tokens: int, reps: int, max_tokens: int, seed_base: int
) -> dict[str, Any]:
    samples: dict[str, list[float]] = {
        "kv_after_prefill_s": [],
        "prefill_compute_s": [],
        "kv_transfer_s": [],
        "prefill_queue_s": [],
        "ttft_s": [],
        "kv_wait_after_first_token_s": [],
        "kv_minus_prefill_s": [],
    }
    before = _wait_stats_settle(handle.base_url)
    for i in range(reps + 1):  # request 0 is a warm-up (first long prompt: allocator, thread pools)
        result = _complete(
            handle.base_url, config.served_model_name, _random_prompt(ids, prompt_tokens, seed_base + i), max_tokens
        )
        timing = result.get("timing") or {}
        if i == 0:
            continue
        if all(k in timing for k in ("kv_transfer_s", "prefill_queue_s", "prefill_compute_s")):
            # a cross-check that does not depend on where the prefill worker stamps "prefill end": decode reservation
            # to KV complete, less the prefill's queue and compute (the same dispatch overhead in both modes)
            timing["kv_minus_prefill_s"] = (
                timing["kv_transfer_s"] - timing["prefill_queue_s"] - timing["prefill_compute_s"]
            )
        for key in samples:
            if key in timing:
                samples[key].append(float(timing[key]))
    moved = _wait_stats_settle(handle.base_url) - before
    out: dict[str, Any] = {"samples": {k: [round(v, 5) for v in vs] for k, vs in samples.items()}}
    for key, values in samples.items():
        med = _median(values)
        out[f"median_{key}"] = None if med is None else round(med, 5)
    out["decode_transfer_bytes_per_request"] = int(moved / (reps + 1)) if moved else None
    return out


def _int8_texts(handle, config, prompts: list[str], max_tokens: int) -> tuple[list[str], int]:
    before = _wait_stats_settle(handle.base_url)
    texts = [_chat(handle.base_url, config.served_model_name, p, max_tokens) for p in prompts]
    return texts, _wait_stats_settle(handle.base_url) - before


def _compare_texts(tokenizer, raw: list[str], int8: list[str]) -> dict[str, Any]:
    rows = []
    for i, (a, b) in enumerate(zip(raw, int8)):
        if a == b:
            rows.append({"prompt": i, "changed": False})
            continue
        first_char = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        ta = tokenizer.encode(a, add_special_tokens=False)
        tb = tokenizer.encode(b, add_special_tokens=False)
        first_tok = next((j for j, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
        rows.append(
            {
                "prompt": i,
                "changed": True,
                "first_diff_token": first_tok,
                "first_diff_char": first_char,
                "raw": a,
                "int8": b,
            }
        )
    changed = [r for r in rows if r["changed"]]
    return {
        "prompts": len(rows),
        "changed": len(changed),
        "first_diff_token_positions": [r["first_diff_token"] for r in changed],
        "rows": rows,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from cluster.config import load_config
    from cluster.run.launch import start_serving
    from cluster.run.ray_cluster import init_local_ray
    from engine.model_loader import load_tokenizer, resolve_model_path

    given = getattr(args, "cluster_config", None)  # a ClusterConfig object (tests) instead of a file
    base = given if given is not None else load_config(getattr(args, "config", "local"))
    base = base.model_copy(deep=True)
    if getattr(args, "model", None):
        base.model.name = args.model
    base.router.port = 0
    chunk = getattr(args, "prefill_chunk", None)
    if chunk:
        base.pools.prefill.max_batch_tokens = chunk
    prompt_tokens = getattr(args, "prompt_tokens", 1024)
    reps = getattr(args, "reps", 5)
    max_tokens = getattr(args, "max_tokens", 4)
    do_overlap = not getattr(args, "no_overlap", False)
    do_int8 = bool(getattr(args, "int8_check", False))

    model_path = str(resolve_model_path(base.model.name))
    tokenizer = load_tokenizer(model_path)
    from engine.blocks import model_kv_bytes_per_token  # in run(): this module is imported to declare options

    per_token = model_kv_bytes_per_token(model_path, base.served_dtype)
    ids = _ordinary_ids(tokenizer, model_path)
    prompts = CHAT_PROMPTS[: max(1, min(len(CHAT_PROMPTS), getattr(args, "int8_prompts", 20)))]
    int8_tokens = getattr(args, "int8_tokens", 64)

    out: dict[str, Any] = {
        "configuration": {
            "model": base.model.name,
            "dtype": base.served_dtype,
            "backend": base.transfer.backend,
            "zmq_transport": base.transfer.zmq_transport,
            "block_size": base.transfer.block_size,
            "prefill_max_batch_tokens": base.pools.prefill.max_batch_tokens,
            "prefill_forwards_per_prompt": -(-prompt_tokens // base.pools.prefill.max_batch_tokens),
            "torch_threads": {"prefill": base.pools.prefill.torch_threads, "decode": base.pools.decode.torch_threads},
            "prompt_tokens": prompt_tokens,
            "reps": reps,
            "max_tokens": max_tokens,
            "cpu_count": os.cpu_count(),
        },
        "kv_bytes_per_token": per_token,
        "kv_bytes_per_request": per_token * prompt_tokens,
    }
    started_ray = False
    if not ray.is_initialized():
        init_local_ray(max(2, os.cpu_count() or 1), base.ray.namespace)
        started_ray = True
    t_start = time.monotonic()
    raw_texts: list[str] | None = None
    raw_bytes = 0
    try:
        modes = [("streamed", True), ("unstreamed", False)] if do_overlap else [("streamed", True)]
        for index, (mode, stream) in enumerate(modes):
            config = base.model_copy(deep=True)
            config.transfer.stream_layers = stream
            config.transfer.kv_wire_dtype = "raw"
            handle = start_serving(config)
            try:
                if do_overlap:
                    out[mode] = _overlap_run(handle, config, ids, prompt_tokens, reps, max_tokens, 1000 * (index + 1))
                if do_int8 and stream:
                    raw_texts, raw_bytes = _int8_texts(handle, config, prompts, int8_tokens)
            finally:
                handle.stop()
        if do_overlap:
            s = out["streamed"]["median_kv_after_prefill_s"]
            u = out["unstreamed"]["median_kv_after_prefill_s"]
            # a negative kv_after_prefill means the KV was complete before the prefill step ended (the last layer's
            # KV leaves before that layer's attention and MLP run): all of it hidden, so the fraction is capped at 1
            out["hidden_fraction"] = round(1 - max(0.0, s) / u, 4) if s is not None and u else None
            out["hidden_fraction_uncapped"] = round(1 - s / u, 4) if s is not None and u else None
            sm, um = out["streamed"]["median_kv_minus_prefill_s"], out["unstreamed"]["median_kv_minus_prefill_s"]
            out["kv_minus_prefill_ms"] = {
                "streamed": None if sm is None else round(1000 * sm, 2),
                "unstreamed": None if um is None else round(1000 * um, 2),
            }
            out["goal_hidden_fraction"] = 0.7
            out["goal_met"] = out["hidden_fraction"] is not None and out["hidden_fraction"] >= 0.7
            out["unstreamed_transfer_gbps"] = round(out["kv_bytes_per_request"] / u / 1e9, 4) if u else None
            tr = out["unstreamed"]["median_kv_transfer_s"]
            out["streamed_kv_after_prefill_ms"] = None if s is None else round(1000 * s, 2)
            out["unstreamed_kv_after_prefill_ms"] = None if u is None else round(1000 * u, 2)
            out["unstreamed_kv_transfer_s"] = tr
        if do_int8:
            config = base.model_copy(deep=True)
            config.transfer.stream_layers = True
            config.transfer.kv_wire_dtype = "int8"
            handle = start_serving(config)
            try:
                int8_texts, int8_bytes = _int8_texts(handle, config, prompts, int8_tokens)
            finally:
                handle.stop()
            cmp = _compare_texts(tokenizer, raw_texts or [], int8_texts)
            cmp.update(
                {
                    "max_tokens": int8_tokens,
                    "comparison": "text; token position by re-tokenizing both outputs",
                    "raw_wire_bytes": raw_bytes,
                    "int8_wire_bytes": int8_bytes,
                    "wire_bytes_ratio": round(int8_bytes / raw_bytes, 4) if raw_bytes else None,
                    "kv_dtype": base.served_dtype,
                }
            )
            out["int8"] = cmp
    finally:
        if started_ray:
            ray.shutdown()
    out["wall_s"] = round(time.monotonic() - t_start, 1)
    return out


if __name__ == "__main__":
    sys.exit(main("python -m benchmarks.overlap_bench", add_arguments, run))
