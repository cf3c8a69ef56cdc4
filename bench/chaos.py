"""``pdserve bench chaos``: a steady load while a decode worker and a prefill worker are killed by PID.

The load behaves like a polite client: after a 429 or 503 it waits ``Retry-After`` before its next request.
Every request must end in exactly one of two ways the client can see: a completed stream, or an explicit error
(an HTTP error status with an OpenAI error body, or an error event in the stream followed by ``[DONE]``). A request
with no answer, or a stream cut without an error event, is *lost*, and the run reports how many (must be 0). After
the load, once Ray has restarted the killed workers and leases have run out, it reports the KV blocks and requests
still held on any worker (must be 0) and the longest time any request outlived its deadline (must be 0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time
from collections import Counter
from pathlib import Path

import httpx

from cluster.config import load_config

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "local.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--model", default=None, help="override model.name")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--request-timeout-s", type=float, default=60.0, help="the router's per-request deadline")
    parser.add_argument("--kill-decode-at", type=float, default=0.25, help="fraction of requests done")
    parser.add_argument("--kill-prefill-at", type=float, default=0.6, help="fraction of requests done")
    parser.add_argument("--settle-timeout-s", type=float, default=90.0)
    parser.add_argument("--json", action="store_true")


PROMPTS = [
    "Tell me about the history of the bicycle.",
    "Why is the sky blue?",
    "List some uses of a paperclip.",
    "What makes a good cup of tea?",
    "Describe a rainy afternoon in a city.",
    "How do plants make food from sunlight?",
]


async def _one(client: httpx.AsyncClient, url: str, model: str, i: int, max_tokens: int) -> dict:
    body = {"model": model, "prompt": f"{PROMPTS[i % len(PROMPTS)]} (request {i})", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    started = time.monotonic()
    outcome, reason, tokens = "lost", "no answer", 0
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                payload = json.loads(await response.aread())
                retry_after = float(response.headers.get("retry-after", 0) or 0)
                return {"outcome": "failed", "reason": f"http_{response.status_code}:{payload['error'].get('code')}",
                        "elapsed_s": time.monotonic() - started, "tokens": 0, "retry_after_s": retry_after}
            saw_error, saw_finish = None, False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    if saw_error:
                        outcome, reason = "failed", f"stream_error:{saw_error}"
                    elif saw_finish:
                        outcome, reason = "completed", ""
                    else:
                        outcome, reason = "lost", "[DONE] without a finish or an error"
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    saw_error = chunk["error"].get("code") or "error"
                    continue
                for choice in chunk.get("choices", []):
                    tokens += 1 if choice.get("text") else 0
                    saw_finish = saw_finish or bool(choice.get("finish_reason"))
            else:
                reason = "stream cut without an error event"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        outcome, reason = "lost", f"{type(exc).__name__}"
    return {"outcome": outcome, "reason": reason, "elapsed_s": time.monotonic() - started, "tokens": tokens}


def _kill(handle, role: str, elapsed: float) -> dict:
    info = next(w for w in handle.worker_infos() if w["role"] == role)
    os.kill(info["pid"], signal.SIGKILL)  # a worker process this run started
    return {"worker": info["name"], "pid": info["pid"], "at_s": round(elapsed, 2)}


async def _load(handle, args, model: str) -> tuple[list[dict], list[dict]]:
    results: list[dict] = []
    kills: list[dict] = []
    started = time.monotonic()
    next_index = 0
    plan = sorted([(args.kill_decode_at, "decode"), (args.kill_prefill_at, "prefill")])
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    client_timeout = httpx.Timeout(args.request_timeout_s + 30)

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal next_index
        while next_index < args.num_requests:
            index = next_index
            next_index += 1
            result = await _one(client, handle.base_url, model, index, args.max_tokens)
            results.append(result)
            if result.get("retry_after_s"):  # a well-behaved client waits as told before its next request
                await asyncio.sleep(result["retry_after_s"])
            while plan and len(results) >= plan[0][0] * args.num_requests:
                _, role = plan.pop(0)
                kills.append(_kill(handle, role, time.monotonic() - started))

    async with httpx.AsyncClient(timeout=client_timeout, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(args.concurrency)))
    return results, kills


def _settle(handle, timeout_s: float) -> tuple[dict, float]:
    """Wait for restarted workers to rejoin and every lease to end; returns the last status and the wait."""
    started = time.monotonic()
    status: dict = {}
    while time.monotonic() - started < timeout_s:
        status = httpx.get(f"{handle.base_url}/status", timeout=5).json()
        workers = status["workers"]
        if all(w["alive"] for w in workers) and status["inflight"] == 0 and all(
            w.get("free_blocks") == w.get("total_blocks") and w.get("requests", 1) == 0 for w in workers
        ):
            break
        time.sleep(0.5)
    return status, time.monotonic() - started


def run(args: argparse.Namespace) -> dict:
    from cluster.launch import start_serving

    config = load_config(args.config)
    if args.model:
        config.model.name = args.model
    config.router.port = 0
    config.router.request_timeout_s = args.request_timeout_s
    handle = start_serving(config)
    try:
        started = time.monotonic()
        results, kills = asyncio.run(_load(handle, args, config.served_model_name))
        load_s = time.monotonic() - started
        status, settle_s = _settle(handle, args.settle_timeout_s)
        restarted = {w["name"]: w.get("pid") for w in handle.worker_infos()}
    finally:
        handle.stop()
    outcomes = Counter(r["outcome"] for r in results)
    held_blocks = sum(max(0, w.get("total_blocks", 0) - w.get("free_blocks", 0)) for w in status.get("workers", []))
    return {
        "model": config.served_model_name,
        "requests_sent": len(results),
        "completed": outcomes["completed"],
        "failed_with_explicit_error": outcomes["failed"],
        "failure_reasons": dict(Counter(r["reason"] for r in results if r["outcome"] == "failed")),
        "lost": outcomes["lost"],
        "lost_reasons": dict(Counter(r["reason"] for r in results if r["outcome"] == "lost")),
        "kv_blocks_held_after": held_blocks,
        "requests_held_after": sum(w.get("requests", 0) for w in status.get("workers", [])) + status.get("inflight", 0),
        "workers_alive_after": sum(1 for w in status.get("workers", []) if w["alive"]),
        "max_over_deadline_s": round(max([0.0] + [r["elapsed_s"] - args.request_timeout_s for r in results]), 3),
        "kills": [dict(k, new_pid=restarted.get(k["worker"])) for k in kills],
        "load_s": round(load_s, 1),
        "settle_s": round(settle_s, 1),
    }
