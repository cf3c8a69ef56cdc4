"""``pdserve bench tp-handoff --degrees P:D,...``: the KV hand-off between tensor-parallel engines of two degrees.

For each (p, d) a prefill engine of p ranks and a decode engine of d ranks run as local processes (engine.tp_launch)
on a random-weight model shaped for KV bytes rather than compute (30 layers of 4 KV heads of 64: 60 KiB per token in
float32). Per repeat, decode rank 0 reserves blocks for ``--requests`` prompts and expects their KV on the backend's
receiver; prefill rank 0 prefills them in one step, streaming each layer's KV (gathered from its ranks) to the sender
as a prefill worker does, and decode rank 0 hands each piece on to its ranks as an import does. Timed: the prefill
step, and from its start until decode holds every request's KV (perf_counter is system-wide on Linux): the hand-off
GB/s, whose time holds the forward producing the KV, as a request's does. Then the last repeat's pieces are sent
again with no forward (``send_only``): the wire and the decode side's hand-on to its ranks, not the prefill side's
gather, which is inside the forward.
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


def _engine(rank: int, size: int, store_path: str, job: dict):
    from engine.llm_engine import LLMEngine

    return LLMEngine(_engine_config(job, size), _group(rank, size, store_path))


def _follower(rank: int, size: int, store_path: str, job: dict) -> dict:
    from engine.tp_launch import serve_follower

    group = _group(rank, size, store_path)
    assert group is not None  # size > 1
    return {"ended": serve_follower(_engine_config(job, size), group)}


def _params():
    from engine.request import SamplingParams

    return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def _decode_main(rank: int, size: int, store_path: str, job: dict) -> dict:
    """Reserve, expect, time each repeat's KV until every request's is in, then free it all."""
    if rank > 0:
        return _follower(rank, size, store_path, job)
    from transfer.base import make_receiver
    from transfer.config import TransferConfig
    from transfer.state import TransferState
    from transfer.wire import ModelFingerprint

    engine = _engine(rank, size, store_path, job)
    fingerprint = ModelFingerprint.from_spec(engine.handoff_spec)
    config = TransferConfig(secret=job["secret"])
    address = "tcp://127.0.0.1:0" if job["backend"] != "shm" else f"shm+ipc://{job['socket']}"
    receiver = make_receiver(job["backend"], fingerprint, engine.kv_importer.write, address, config)
    done_at: list[float] = []
    try:
        for repeat in range(2 * (job["repeats"] + 1)):  # streamed, then replayed
            rids = [f"r{repeat}-{i}" for i in range(job["requests"])]
            offer = {}
            for rid, prompt in zip(rids, job["prompts"]):
                if engine.kv_importer.reserve(prompt, _params(), rid) is None:
                    raise RuntimeError("the decode engine could not reserve the KV of a repeat")
                blocks = engine.kv_importer.expected_blocks(engine.requests[rid])
                receiver.expect(rid, blocks)
                offer[rid] = blocks
            job["offers"].put((receiver.address, offer))
            waiting, deadline = set(rids), time.monotonic() + WAIT_S
            while waiting and time.monotonic() < deadline:
                for event in receiver.poll():
                    if event.transfer_id in waiting:
                        if event.state != TransferState.DONE:
                            raise RuntimeError(f"transfer {event.transfer_id} failed: {event.error}")
                        waiting.discard(event.transfer_id)
                time.sleep(0.0002)
            if waiting:
                raise RuntimeError(f"{len(waiting)} transfers did not end within {WAIT_S:.0f} s")
            done_at.append(time.perf_counter())
            for rid in rids:
                engine.abort(rid)
        engine.check_no_leaks()
    finally:
        receiver.close()
        engine.close()
    return {"done_at": done_at, "kv_bytes": engine.handoff_spec.bytes_per_token * sum(map(len, job["prompts"]))}


def _streaming_sink(sender, rid: str, blocks: list[int], kept: list):
    """A prefill worker's sink (each piece onto the reserved blocks, sent at once) that also keeps a copy."""

    def sink(ready) -> None:
        sender.send_layer(rid, ready.layer, blocks[ready.first_block : ready.end_block], ready.k, ready.v)
        kept.append((ready.layer, ready.first_block, ready.end_block, ready.k.clone(), ready.v.clone()))

    return sink


def _prefill_main(rank: int, size: int, store_path: str, job: dict) -> dict:
    """Each repeat's prompts prefilled in one step, every layer's KV streamed to the decode engine's blocks; then the
    last repeat's pieces sent again alone (``replays``), to time the wire and the decode side without the forward."""
    if rank > 0:
        return _follower(rank, size, store_path, job)
    from engine.outputs import FinishReason
    from transfer.base import make_sender
    from transfer.config import TransferConfig
    from transfer.wire import ModelFingerprint

    engine = _engine(rank, size, store_path, job)
    config = TransferConfig(secret=job["secret"])
    sender = make_sender(job["backend"], ModelFingerprint.from_spec(engine.handoff_spec), config)
    steps: list[tuple[float, float]] = []
    replays: list[float] = []
    pieces: dict[int, list] = {}  # per prompt: (layer, first block, end block, k, v) of the latest streamed repeat

    def acknowledged(rids) -> None:
        pending, deadline = set(rids), time.monotonic() + WAIT_S
        while pending and time.monotonic() < deadline:
            for event in sender.poll():
                pending.discard(event.transfer_id)
                engine.abort(event.transfer_id)  # its lease ended: the blocks go back (nothing, for a replay)
            time.sleep(0.0002)

    try:
        for _ in range(job["repeats"] + 1):
            address, offer = job["offers"].get(timeout=WAIT_S)
            pieces.clear()
            for i, (rid, prompt) in enumerate(zip(offer, job["prompts"])):
                sink = _streaming_sink(sender, rid, offer[rid], pieces.setdefault(i, []))
                engine.add_request(prompt, _params(), rid, prefill_only=True, kv_sink=sink, stream_kv=True)
                sender.begin(rid, address)
            start = time.perf_counter()
            outputs = engine.step()
            steps.append((start, time.perf_counter()))
            for output in outputs:
                if output.finish_reason is not FinishReason.PREFILLED:
                    raise RuntimeError(f"{output.request_id} did not prefill in one step: {output.error}")
                sender.finish(output.request_id)
            acknowledged(offer)
        for _ in range(job["repeats"] + 1):
            address, offer = job["offers"].get(timeout=WAIT_S)
            replays.append(time.perf_counter())
            for i, rid in enumerate(offer):
                sender.begin(rid, address)
                for layer, first, end, k, v in pieces[i]:
                    sender.send_layer(rid, layer, offer[rid][first:end], k, v)
                sender.finish(rid)
            acknowledged(offer)
        engine.check_no_leaks()
    finally:
        sender.close()
        engine.close()
    return {"steps": steps, "replays": replays}


def _pair(prefill_degree: int, decode_degree: int, job: dict) -> dict:
    import multiprocessing

    from engine.tp_launch import run_ranks

    job = job | {"offers": multiprocessing.get_context("spawn").Queue()}
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
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from engine.tiny_model import build_tiny_model

    pairs = parse_degrees(args.degrees)
    for flag, value in (("--requests", args.requests), ("--prompt-len", args.prompt_len), ("--reps", args.reps)):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 250) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    block_size = 16
    kv_blocks = 2 * args.requests * (-(-args.prompt_len // block_size)) + 8
    with tempfile.TemporaryDirectory(prefix="pdserve-tp-handoff-") as folder:
        model = build_tiny_model(Path(folder) / "model", **MODEL_SHAPE)
        job = {
            "model": str(model),
            "backend": args.handoff_backend,
            "secret": secrets.token_hex(16),
            "socket": str(Path(folder) / "kv.sock"),
            "requests": args.requests,
            "prompt_len": args.prompt_len,
            "prompts": prompts,
            "repeats": args.reps,
            "kv_blocks": kv_blocks,
        }
        by_pair = {f"{p}:{d}": _pair(p, d, job) for p, d in pairs}
    base = next(iter(by_pair.values()))
    first = next(iter(by_pair))
    for figures in by_pair.values():
        figures[f"handoff_vs_{first}"] = round(figures["handoff_ms"] / base["handoff_ms"], 3)
    return {
        "benchmark": "KV hand-off between tensor-parallel engines (prefill p ranks -> decode d ranks)",
        "model": "random weights: " + ", ".join(f"{k} {v}" for k, v in MODEL_SHAPE.items()) + ", float32",
        "backend": args.handoff_backend,
        "requests": args.requests,
        "prompt_len": args.prompt_len,
        "reps": args.reps,
        "threads_per_rank": 1,
        "pairs": by_pair,
    }


if __name__ == "__main__":
    sys.exit(main("python -m benchmarks.tp_handoff_bench", add_arguments, run))
