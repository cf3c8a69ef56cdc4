"""``pdserve bench chaos``: a steady load while a decode worker and a prefill worker are killed.

With Ray, workers are processes, SIGKILLed by PID and restarted by Ray; with ``--in-process`` they are threads and a
kill is ``WorkerActor.kill()``: the worker stops dead and closes its sockets (to the router, heartbeats stop, as for a
dead process) and nothing restarts it. With spare replicas a request with no token yet is re-dispatched to a
survivor; only streams mid-generation on the killed decode worker end with a ``worker_died`` error event. The client
waits ``Retry-After`` after a 429 or 503. A request that ends in neither a completed stream nor an explicit error
(an HTTP error with an OpenAI body, or an error event then ``[DONE]``) is *lost*. Must be 0: lost requests, and
after the load settles, KV blocks and requests held, time past any deadline, and 503s (with a spare of each pool).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from collections import Counter

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.options import add_chaos_arguments as add_arguments
from benchmarks.options import main
from cluster.config import load_config

PROMPTS = [
    "Tell me about the history of the bicycle.",
    "Why is the sky blue?",
    "List some uses of a paperclip.",
    "What makes a good cup of tea?",
    "Describe a rainy afternoon in a city.",
    "How do plants make food from sunlight?",
]


async def _one(client: httpx.AsyncClient, url: str, model: str, i: int, max_tokens: int) -> dict:
    body = {
        "model": model,
        "prompt": f"{PROMPTS[i % len(PROMPTS)]} (request {i})",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    started = time.monotonic()
    outcome, reason, tokens, status, message = "lost", "no answer", 0, None, ""
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            status = response.status_code
            if response.status_code != 200:
                payload = json.loads(await response.aread())
                retry_after = float(response.headers.get("retry-after", 0) or 0)
                return {
                    "outcome": "failed",
                    "reason": f"http_{response.status_code}:{payload['error'].get('code')}",
                    "elapsed_s": time.monotonic() - started,
                    "tokens": 0,
                    "retry_after_s": retry_after,
                    "status": response.status_code,
                }
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
                    message = str(chunk["error"].get("message"))
                    continue
                for choice in chunk.get("choices", []):
                    tokens += 1 if choice.get("text") else 0
                    saw_finish = saw_finish or bool(choice.get("finish_reason"))
            else:
                reason = "stream cut without an error event"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        outcome, reason = "lost", f"{type(exc).__name__}"
    return {
        "outcome": outcome,
        "reason": reason,
        "elapsed_s": time.monotonic() - started,
        "tokens": tokens,
        "status": status,
        "message": message,
    }


def _victim(handle, role: str) -> str:
    """The live worker of ``role`` that holds the most requests right now (ties: the first)."""
    live = sorted(handle.router.live(role), key=lambda w: -w.inflight)
    return live[0].name if live else next(w.name for w in handle.workers if w.role == role)


async def _kill(handle, role: str, elapsed: float, in_process: bool) -> dict:
    name = _victim(handle, role)
    record = next(w for w in handle.workers if w.name == name)
    kill = {"worker": name, "at_s": round(elapsed, 2), "inflight": handle.router.members.get(name).inflight}
    if in_process:
        await asyncio.to_thread(record.actor.kill)  # joins the worker's threads: off the load's event loop
    else:
        kill["pid"] = record.info["pid"]
        os.kill(record.info["pid"], signal.SIGKILL)  # a worker process this run started
    killed = time.monotonic()
    while time.monotonic() - killed < 30 and name in [w.name for w in handle.router.live(role)]:
        await asyncio.sleep(0.05)
    kill["detected_after_s"] = round(time.monotonic() - killed, 2)  # when the router stopped routing to it
    return kill


async def _load(handle, args, model: str, in_process: bool) -> tuple[list[dict], list[dict]]:
    results: list[dict] = []
    kills: list[asyncio.Task] = []  # each kill runs beside the load: the client that triggers it keeps sending
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
            if result.get("retry_after_s"):
                await asyncio.sleep(result["retry_after_s"])
            while plan and len(results) >= plan[0][0] * args.num_requests:
                _, role = plan.pop(0)
                kills.append(asyncio.create_task(_kill(handle, role, time.monotonic() - started, in_process)))

    async with httpx.AsyncClient(timeout=client_timeout, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(args.concurrency)))
    return results, [await kill for kill in kills]


def _idle(worker: dict) -> bool:
    return (
        worker.get("free_blocks") == worker.get("total_blocks")
        and worker.get("requests", 1) == 0
        and worker.get("awaiting_kv", 0) == 0
        and worker.get("leased_transfers", 0) == 0
    )


def _settle(handle, timeout_s: float, expected_alive: int) -> tuple[dict, float]:
    """Wait for restarted workers to rejoin (Ray) and every lease to end on the live ones; the last status, the wait."""
    started = time.monotonic()
    status: dict = {}
    while time.monotonic() - started < timeout_s:
        status = httpx.get(f"{handle.base_url}/status", timeout=5).json()
        live = [w for w in status["workers"] if w["alive"]]
        if len(live) >= expected_alive and status["inflight"] == 0 and all(_idle(w) for w in live):
            break
        time.sleep(0.5)
    return status, time.monotonic() - started


def _metric(base_url: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(httpx.get(f"{base_url}/metrics", timeout=5).text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def run(args: argparse.Namespace) -> dict:
    from cluster.run.launch import start_serving

    config = load_config(args.config)
    if args.model:
        config.model.name = args.model
    in_process = getattr(args, "in_process", False)
    for pool, replicas in (
        (config.pools.prefill, getattr(args, "prefill_replicas", None)),
        (config.pools.decode, getattr(args, "decode_replicas", None)),
    ):
        if replicas is not None:
            pool.replicas = replicas
    config.router.port = 0
    config.router.request_timeout_s = args.request_timeout_s
    handle = start_serving(config, in_process=in_process)
    try:
        started = time.monotonic()
        results, kills = asyncio.run(_load(handle, args, config.served_model_name, in_process))
        load_s = time.monotonic() - started
        expected_alive = handle.num_workers - (len(kills) if in_process else 0)
        status, settle_s = _settle(handle, args.settle_timeout_s, expected_alive)
        retried = _metric(handle.base_url, "pdserve_errors_total", reason="retried_after_worker_death")
        restarted = {w["name"]: w.get("pid") for w in handle.worker_infos()}
    finally:
        handle.stop()
    outcomes = Counter(r["outcome"] for r in results)
    live = [w for w in status.get("workers", []) if w["alive"]]  # a dead worker's last heartbeat is stale
    held_blocks = sum(max(0, w.get("total_blocks", 0) - w.get("free_blocks", 0)) for w in live)
    if not in_process:
        kills = [dict(k, new_pid=restarted.get(k["worker"])) for k in kills]
    return {
        "model": config.served_model_name,
        "in_process": in_process,
        "replicas": {"prefill": config.pools.prefill.replicas, "decode": config.pools.decode.replicas},
        "requests_sent": len(results),
        "completed": outcomes["completed"],
        "failed_with_explicit_error": outcomes["failed"],
        "failure_reasons": dict(Counter(r["reason"] for r in results if r["outcome"] == "failed")),
        # which death ended each worker_died stream (the router names the worker in the message)
        "worker_died_by": dict(
            Counter(
                k["worker"]
                for r in results
                if r["reason"] == "stream_error:worker_died"
                for k in kills
                if f"({k['worker']})" in r.get("message", "")
            )
        ),
        "lost": outcomes["lost"],
        "lost_reasons": dict(Counter(r["reason"] for r in results if r["outcome"] == "lost")),
        "http_503": sum(1 for r in results if r["status"] == 503),
        "http_status_counts": dict(Counter(str(r["status"] or "none") for r in results)),
        "retried_after_worker_death": int(retried),
        "kv_blocks_held_after": held_blocks,
        "requests_held_after": sum(
            w.get("requests", 0) + w.get("awaiting_kv", 0) + w.get("leased_transfers", 0) for w in live
        )
        + status.get("inflight", 0),
        "workers_alive_after": len(live),
        "max_over_deadline_s": round(max([0.0] + [r["elapsed_s"] - args.request_timeout_s for r in results]), 3),
        "max_elapsed_s": round(max([0.0] + [r["elapsed_s"] for r in results]), 2),
        "kills": kills,
        "load_s": round(load_s, 1),
        "settle_s": round(settle_s, 1),
    }


if __name__ == "__main__":
    sys.exit(main("python -m benchmarks.chaos", add_arguments, run))
