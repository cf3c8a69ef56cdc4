"""``pdserve bench tp-handoff --degrees P:D,...``: the KV hand-off between tensor-parallel engines of two degrees.

For each (p, d) a prefill engine of p ranks and a decode engine of d ranks run as local processes (engine.tp_launch)
on a random-weight model shaped for KV bytes rather than compute (30 layers of 4 KV heads of 64: 60 KiB per token in
float32). Every rank holds its own KV endpoints (worker/rank_kv.py), as a worker's ranks do: each prefill rank sends
the heads it computed straight to the decode rank(s) that hold them, and rank 0 on each side only joins the parts'
ends. Per repeat, decode rank 0 reserves blocks for ``--requests`` prompts and expects their parts; prefill rank 0
prefills them in one step, every rank streaming each layer's heads as a prefill worker does. Timed: the prefill step,
and from its start until decode rank 0 knows every request's KV complete on every rank (perf_counter is system-wide on
Linux): the hand-off GB/s, whose time holds the forward producing the KV, as a request's does. Then the last repeat's
prefilled KV, still held, is sent again with no forward (``send_only``: every rank reads its heads of the held blocks
and sends them at once), which times the wire and the receiving ranks alone.
"""

from __future__ import annotations

import argparse
import random
import secrets
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.options import add_tp_handoff_bench_arguments as add_arguments
from benchmarks.options import main

MODEL_SHAPE = {
    "num_hidden_layers": 30,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "intermediate_size": 128,
}
WAIT_S = 120.0  # one repeat's KV, or the other side's offer


def parse_degrees(text: str) -> list[tuple[int, int]]:
    pairs = []
    for part in text.split(","):
        try:
            p, d = (int(x) for x in part.split(":"))
        except ValueError:
            raise ValueError(f"--degrees: PREFILL:DECODE pairs such as 2:1, got {part!r}") from None
        if p < 1 or d < 1:
            raise ValueError(f"--degrees: degrees are at least 1, got {part!r}")
        pairs.append((p, d))
    return pairs


def _engine_config(job: dict, size: int):
    from engine.config import EngineConfig

    return EngineConfig(
        model=job["model"],
        dtype="float32",
        kv_blocks=job["kv_blocks"],
        max_batch_tokens=job["requests"] * job["prompt_len"],
        enable_prefix_caching=False,  # every repeat moves all of its KV
        tensor_parallel_size=size,
    )


def _group(rank: int, size: int, store_path: str):
    import torch
    import torch.distributed as dist

    from engine.tensor_parallel import TPGroup

    torch.set_num_threads(1)
    return TPGroup(dist.FileStore(store_path, size), rank, size, 60.0) if size > 1 else None


def _rank_kv(job: dict, side: str, rank: int, kv_spec, split, cache, land=None):
    """A rank's endpoints on the bench's backend (a worker builds them from its spec: worker.rank_kv.rank_kv)."""
    from transfer.config import TransferConfig
    from worker.rank_kv import plain_rank_kv

    shm = job["backend"] == "shm"
    address = f"shm+ipc://{job['folder']}/kv-{side}-{rank}.sock" if shm else "tcp://127.0.0.1:0"
    config = TransferConfig(secret=job["secret"])
    return plain_rank_kv(kv_spec, split, cache, job["backend"], config, land, address)


def _follower(rank: int, size: int, store_path: str, job: dict, receives: bool) -> dict:
    from engine.tp_launch import serve_follower
    from worker.rank_kv import cache_land

    def make_kv(parts):
        land = cache_land(parts.kv_cache) if receives else None
        kv = _rank_kv(
            job, "decode" if receives else "prefill", rank, parts.kv_spec, parts.runner.head_split, parts.kv_cache, land
        )
        kv.start_polling()
        return kv

    group = _group(rank, size, store_path)
    assert group is not None  # size > 1
    return {"ended": serve_follower(_engine_config(job, size), group, make_kv)}


def _engine(rank: int, size: int, store_path: str, job: dict, receives: bool):
    """Rank 0's engine and its endpoints: a receiver (decode) or a sender (prefill) over every rank's."""
    from engine.llm_engine import LLMEngine
    from worker.handoff_join import HandoffReceiver, HandoffSender

    engine = LLMEngine(_engine_config(job, size), _group(rank, size, store_path))
    land = engine.kv_importer.write if receives else None
    side = "decode" if receives else "prefill"
    kv = _rank_kv(job, side, rank, engine.kv_spec, engine.runner.head_split, engine.kv_cache, land)
    channel = engine.runner.step_channel
    endpoint = HandoffReceiver(kv, channel) if receives else HandoffSender(kv, channel)
    return engine, kv, endpoint


def _params():
    from engine.request import SamplingParams

    return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def _wait(poll, ids, what: str) -> None:
    """Every id's end (DONE, or raise), polling for at most WAIT_S."""
    from transfer.state import TransferState

    waiting, deadline = set(ids), time.monotonic() + WAIT_S
    while waiting:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: {len(waiting)} transfers did not end within {WAIT_S:.0f} s")
        for event in poll():
            if event.transfer_id in waiting:
                if event.state != TransferState.DONE:
                    raise RuntimeError(f"{what}: transfer {event.transfer_id} failed: {event.error}")
                waiting.discard(event.transfer_id)
        time.sleep(0.0002)


def _decode_main(rank: int, size: int, store_path: str, job: dict) -> dict:
    """Reserve, expect every rank's parts, time each repeat's KV until every rank holds it, then free it all."""
    if rank > 0:
        return _follower(rank, size, store_path, job, receives=True)
    engine, kv, receiver = _engine(rank, size, store_path, job, receives=True)
    done_at: list[float] = []
    try:
        for repeat in range(2 * (job["repeats"] + 1)):  # streamed, then sent again from the held blocks
            rids = [f"r{repeat}-{i}" for i in range(job["requests"])]
            offer = {}
            for rid, prompt in zip(rids, job["prompts"]):
                if engine.kv_importer.reserve(prompt, _params(), rid) is None:
                    raise RuntimeError("the decode engine could not reserve the KV of a repeat")
                blocks = engine.kv_importer.expected_blocks(engine.requests[rid])
                receiver.expect(rid, blocks, source_degree=job["prefill_degree"])
                offer[rid] = blocks
            job["offers"].put((receiver.address, offer))
            _wait(receiver.poll, rids, "decode")
            done_at.append(time.perf_counter())
            for rid in rids:
                engine.abort(rid)
        engine.check_no_leaks()
        left = len(receiver.pending_transfers())
        job["senders_done"].get(timeout=WAIT_S)  # the receivers stay until every lease's end reached its sender
    finally:
        engine.close()  # stops the followers
        kv.close()
    return {"done_at": done_at, "kv_bytes": job["kv_bytes"], "left": left}


def _prefill_main(rank: int, size: int, store_path: str, job: dict) -> dict:
    """Each repeat's prompts prefilled in one step, every rank streaming its heads of every layer to the decode
    engine's ranks; then the last repeat's KV, held, sent again alone (``replays``), without the forward."""
    if rank > 0:
        return _follower(rank, size, store_path, job, receives=False)
    from engine.outputs import FinishReason

    engine, kv, sender = _engine(rank, size, store_path, job, receives=False)
    layers = range(engine.kv_spec.num_layers)
    steps: list[tuple[float, float]] = []
    replays: list[float] = []
    held: list[str] = []  # the last streamed repeat's requests, kept to be sent again
    try:
        for _ in range(job["repeats"] + 1):
            address, offer = job["offers"].get(timeout=WAIT_S)
            for rid in held:
                engine.release(rid)
            held = list(offer)
            for rid, prompt in zip(offer, job["prompts"]):
                sink = sender.sink(rid, offer[rid])
                engine.add_request(prompt, _params(), rid, prefill_only=True, kv_sink=sink, stream_kv=True)
                sender.begin(rid, address, offer[rid])
            start = time.perf_counter()
            outputs = engine.step()
            steps.append((start, time.perf_counter()))
            for output in outputs:
                if output.finish_reason is not FinishReason.PREFILLED:
                    raise RuntimeError(f"{output.request_id} did not prefill in one step: {output.error}")
                sender.finish(output.request_id)
            _wait(sender.poll, offer, "prefill")
        for _ in range(job["repeats"] + 1):
            address, offer = job["offers"].get(timeout=WAIT_S)
            replays.append(time.perf_counter())
            for source, rid in zip(held, offer):
                request = engine.requests[source]
                dst = offer[rid]
                sender.begin(rid, address, dst)
                sender.send_held(rid, list(request.block_ids), dst, layers)  # the other ranks start theirs first
                engine.kv_exporter.export_held(request, sender.sink(rid, dst), 0, len(dst), layers)
                sender.finish(rid)
            _wait(sender.poll, offer, "prefill (sent again)")
        job["senders_done"].put(True)
        for rid in held:
            engine.release(rid)
        engine.check_no_leaks()
        left = len(sender.active_transfers())
    finally:
        engine.close()
        kv.close()
    return {"steps": steps, "replays": replays, "left": left}


def _pair(prefill_degree: int, decode_degree: int, job: dict) -> dict:
    import multiprocessing

    from engine.tp_launch import run_ranks

    spawn = multiprocessing.get_context("spawn")
    job = job | {"offers": spawn.Queue(), "senders_done": spawn.Queue(), "prefill_degree": prefill_degree}
    results: dict[str, Any] = {}

    def side(name: str, main, degree: int) -> None:
        try:
            results[name] = run_ranks(main, degree, job, timeout_s=600)[0]
        except BaseException as exc:  # noqa: BLE001 - raised in the caller below
            results[name] = exc

    threads = [
        threading.Thread(target=side, args=("decode", _decode_main, decode_degree)),
        threading.Thread(target=side, args=("prefill", _prefill_main, prefill_degree)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(900)
    for name in ("decode", "prefill"):
        if isinstance(results.get(name), BaseException) or name not in results:
            raise RuntimeError(f"({prefill_degree}, {decode_degree}) {name}: {results.get(name, 'never ended')}")
    streamed = len(results["prefill"]["steps"])
    done_at = results["decode"]["done_at"]
    steps = results["prefill"]["steps"][1:]  # the first of each phase: warm-up
    replays = results["prefill"]["replays"][1:]
    kv_bytes = results["decode"]["kv_bytes"]
    handoff_s = statistics.median(done - start for (start, _), done in zip(steps, done_at[1:streamed]))
    replay_s = statistics.median(done - start for start, done in zip(replays, done_at[streamed + 1 :]))
    return {
        "prefill_step_ms": round(1000 * statistics.median(end - start for start, end in steps), 2),
        "handoff_ms": round(1000 * handoff_s, 2),
        "after_step_ms": round(1000 * statistics.median(d - end for (_, end), d in zip(steps, done_at[1:streamed])), 2),
        "kv_mib": round(kv_bytes / 2**20, 2),
        "handoff_gb_s": round(kv_bytes / handoff_s / 1e9, 4),
        "send_only_ms": round(1000 * replay_s, 2),
        "send_only_gb_s": round(kv_bytes / replay_s / 1e9, 4),
        "transfers_left": results["prefill"]["left"] + results["decode"]["left"],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from engine.cpu_info import cpu_model
    from engine.tiny_model import build_tiny_model

    pairs = parse_degrees(args.degrees)
    for flag, value in (("--requests", args.requests), ("--prompt-len", args.prompt_len), ("--reps", args.reps)):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 250) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    block_size = 16
    kv_blocks = 2 * args.requests * (-(-args.prompt_len // block_size)) + 8
    per_token = 2 * MODEL_SHAPE["num_hidden_layers"] * MODEL_SHAPE["num_key_value_heads"] * MODEL_SHAPE["head_dim"] * 4
    with tempfile.TemporaryDirectory(prefix="pdserve-tp-handoff-") as folder:
        model = build_tiny_model(Path(folder) / "model", **MODEL_SHAPE)
        job = {
            "model": str(model),
            "backend": args.handoff_backend,
            "secret": secrets.token_hex(16),
            "folder": folder,
            "requests": args.requests,
            "prompt_len": args.prompt_len,
            "prompts": prompts,
            "repeats": args.reps,
            "kv_blocks": kv_blocks,
            "kv_bytes": per_token * args.requests * args.prompt_len,
        }
        by_pair = {f"{p}:{d}": _pair(p, d, job) for p, d in pairs}
    base = next(iter(by_pair.values()))
    first = next(iter(by_pair))
    for figures in by_pair.values():
        figures[f"handoff_vs_{first}"] = round(figures["handoff_ms"] / base["handoff_ms"], 3)
        figures[f"send_only_gb_s_vs_{first}"] = round(figures["send_only_gb_s"] / base["send_only_gb_s"], 3)
    return {
        "benchmark": "KV hand-off between tensor-parallel engines (prefill p ranks -> decode d ranks, rank to rank)",
        "model": "random weights: " + ", ".join(f"{k} {v}" for k, v in MODEL_SHAPE.items()) + ", float32",
        "cpu": cpu_model(),
        "backend": args.handoff_backend,
        "requests": args.requests,
        "prompt_len": args.prompt_len,
        "reps": args.reps,
        "threads_per_rank": 1,
        "pairs": by_pair,
    }


if __name__ == "__main__":
    sys.exit(main("python -m benchmarks.tp_handoff_bench", add_arguments, run))
