"""``pdserve demo``: a local cluster from the shipped ``local`` config, used as a client would.

Streams one chat answer to the terminal, sends a few more concurrently, prints TTFT and TPOT per request and the
router's own added latency (from each response's timing), then shuts everything down.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from typing import Any

import httpx

from cluster.config import load_config

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for staying focused.",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one sentence.",
    "Name three primary colors.",
    "What does a compiler do?",
]
DEFAULT_CONFIG = "local"  # the shipped configs/local.yaml, found as package data (cluster.config.find_config)


async def _chat(client: httpx.AsyncClient, url: str, model: str, question: str, max_tokens: int, echo: bool) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    stamps: list[float] = []
    text = ""
    usage: dict[str, Any] = {}
    timing: dict[str, Any] = {}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {await response.aread()!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                usage = chunk["usage"]
            timing = chunk.get("timing", timing)
            for choice in chunk.get("choices", []):
                piece = choice["delta"].get("content")
                if piece:
                    stamps.append(time.perf_counter())
                    text += piece
                    if echo:
                        print(piece, end="", flush=True)
    done = time.perf_counter()
    tokens = usage.get("completion_tokens", len(stamps))
    ttft = (stamps[0] if stamps else done) - sent
    tpot = (done - sent - ttft) / (tokens - 1) if tokens > 1 else 0.0
    return {"question": question, "text": text, "tokens": tokens, "ttft_s": ttft, "tpot_s": tpot, "timing": timing}


async def _drive(url: str, model: str, max_tokens: int) -> list[dict]:
    async with httpx.AsyncClient(timeout=300) as client:
        print(f"\n> {QUESTIONS[0]}\n", end="", flush=True)
        first = await _chat(client, url, model, QUESTIONS[0], max_tokens, echo=True)
        print("\n")
        started = time.perf_counter()
        rest = await asyncio.gather(*(_chat(client, url, model, q, max_tokens, False) for q in QUESTIONS[1:]))
        elapsed = time.perf_counter() - started
    generated = sum(r["tokens"] for r in rest)
    print(
        f"{len(rest)} concurrent requests: {generated} tokens in {elapsed:.1f} s = "
        f"{generated / elapsed:.1f} generated tokens/s\n"
    )
    return [first, *rest]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def _decode_step_line(workers: list[dict]) -> str:
    """Whether decode ran on the compiled step (engine/compile_cache.py): kept on disk by an earlier run's background
    compile, or compiling now, this run decoding eagerly (counters as of each worker's last heartbeat)."""
    static = sum(int(w.get("static_decode_steps", 0)) for w in workers if w["role"] != "prefill")
    if static:
        return f"decode ran on the compiled step ({static} steps as of the last heartbeats)"
    return (
        "decode ran eagerly: the compiled step is compiling in the background, once per machine (the next run loads"
        " it), or is off for this config (compile_decode_batches)"
    )


def run_demo(args: argparse.Namespace) -> int:
    from cluster.run.launch import start_serving

    config = load_config(args.config or DEFAULT_CONFIG)
    if args.model:
        config.model.name = args.model
    config.router.port = 0  # never collide with a server already running on the usual port
    print(f"starting a local pdserve cluster ({config.mode}, model {config.model.name}) ...", flush=True)
    started = time.perf_counter()
    handle = start_serving(config)
    try:
        print(
            f"ready in {time.perf_counter() - started:.1f} s at {handle.base_url}/v1 with workers: "
            + ", ".join(f"{w['name']} (pid {w['pid']})" for w in handle.worker_infos()),
            flush=True,
        )
        results = asyncio.run(_drive(handle.base_url, config.served_model_name, args.max_tokens))
        print(f"{'request':<44}{'tokens':>7}{'TTFT ms':>9}{'TPOT ms':>9}")
        for r in results:
            print(f"{r['question'][:42]:<44}{r['tokens']:>7}{r['ttft_s'] * 1000:>9.0f}{r['tpot_s'] * 1000:>9.1f}")
        for r in results[1:]:
            print(f"\n> {r['question']}\n{r['text'].strip()}")
        overhead = [
            r["timing"].get("router_queue_s", 0) + r["timing"].get("first_token_delivery_s", 0) for r in results
        ]
        summary = {
            "ttft_ms_median": round(statistics.median(r["ttft_s"] for r in results) * 1000, 1),
            "tpot_ms_median": round(statistics.median(r["tpot_s"] for r in results) * 1000, 1),
            "router_added_ms_median": round(statistics.median(overhead) * 1000, 2),
            "router_added_ms_p99": round(_percentile(overhead, 99) * 1000, 2),
        }
        print("\n" + json.dumps(summary))
        status = httpx.get(f"{handle.base_url}/status", timeout=10).json()
        moved = sum(w.get("transfer_bytes", 0) for w in status["workers"] if w["role"] == "decode")
        if config.mode == "disaggregated":
            print(
                f"KV moved prefill -> decode: {moved / 1e6:.1f} MB in "
                f"{sum(int(w.get('transfers_ok', 0)) for w in status['workers'] if w['role'] == 'decode')} transfers"
            )
        print(_decode_step_line(status["workers"]))
    finally:
        print("shutting down ...", flush=True)
        handle.stop()
    return 0


if __name__ == "__main__":
    sys.exit(run_demo(argparse.Namespace(config=None, model=None, max_tokens=48)))
