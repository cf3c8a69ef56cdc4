"""``pdserve profile``: measure prefill, decode and KV transfer times on this machine, with a config's engines.

The engines run directly (no Ray, no HTTP: the simulator needs one forward's cost, not the control plane's), built
from the config's ``WorkerSpec``\\ s, so every setting is the workers' own: the prefill engine first, then the decode
engine, each at one tensor-parallel degree (at degree N as N local processes, ``engine.tp_launch``, rank 0
measuring). Each point is the median of ``repeats`` timings after a warm-up (more for very short steps:
``samples_needed``); transfers are planner/profile_transfer.py's. ``planner.fit`` then fits the curves the simulator
reads. What each point measures: docs/planner.md.
"""

from __future__ import annotations

import dataclasses
import datetime
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm import tqdm
from transformers import AutoConfig

from cluster.config import ClusterConfig
from engine.blocks import blocks_for_tokens
from engine.expert_parallel import degree_field
from engine.llm_engine import LLMEngine
from engine.model_loader import resolve_model_path
from engine.request import RequestStatus, SamplingParams
from engine.tensor_parallel import TPGroup
from engine.tp_launch import run_ranks
from engine.tp_shard import check_degree
from planner.fit import fit_points
from planner.profile_model import (
    DECODE_FEATURES,
    PREFILL_FEATURES,
    TRANSFER_FEATURES,
    DecodePoint,
    Fit,
    PrefillPoint,
    Profile,
    TransferPoint,
)
from planner.profile_transfer import measure_transfer
from worker.spec import WorkerSpec, resolve_spec
from worker.tp_rank import TPRank, join_group

MAX_TRANSFER_BYTES = 64 * 1024 * 1024
MIN_SAMPLED_S = 0.05  # keep timing a point until its samples add up to this (or MAX_SAMPLES)
MAX_SAMPLES = 15
PART_TIMEOUT_S = 3600.0  # one pool's measurement at degree > 1, its ranks' start included


def samples_needed(times: list[float], repeats: int) -> bool:
    """Fewer than ``repeats`` timings, or all together still so short that one descheduling would sway the median."""
    return len(times) < repeats or (sum(times) < MIN_SAMPLED_S and len(times) < MAX_SAMPLES)


Tick = Callable[..., object]  # tqdm's update: tick() or tick(n)


@dataclass(slots=True)
class PrefillGrid:
    """Which prefill points to measure; ``prefill_grid`` sizes it from the prefill engine's limits."""

    tokens: list[int]  # first chunks (nothing cached)
    context: list[tuple[int, int]]  # (context, tokens): a chunk after cached tokens
    repeats: int = 3

    @property
    def num_measurements(self) -> int:
        return len(self.tokens) + len(self.context)


@dataclass(slots=True)
class DecodeGrid:
    """Which decode and transfer points to measure; ``decode_grid`` sizes it from the decode engine's limits."""

    contexts: list[int]  # per request
    batches: list[int]  # at most max_num_seqs (and what the KV cache holds, checked per context)
    transfer_blocks: list[int]  # empty: colocated, no KV moves
    repeats: int = 3

    @property
    def num_measurements(self) -> int:
        return len(self.contexts) * len(self.batches) + len(self.transfer_blocks)


def geometric(low: int, high: int, count: int) -> list[int]:
    """``count`` integers from ``low`` to ``high`` (both included), evenly spaced on a log scale, without repeats."""
    if high <= low or count <= 1:
        return [max(low, high)]
    ratio = (high / low) ** (1 / (count - 1))
    return sorted({min(high, round(low * ratio**i)) for i in range(count)} | {high})


def _round_down(value: int, multiple: int) -> int:
    return max(multiple, value // multiple * multiple)


def prefill_grid(prefill: LLMEngine, quick: bool) -> PrefillGrid:
    """Chunk sizes up to ``max_batch_tokens`` (within the model length and KV cache), contexts that fit beside them."""
    block = prefill.config.block_size
    prefill_tokens_cap = prefill.block_manager.num_blocks * block - block
    longest = min(prefill.config.max_batch_tokens, prefill.max_model_len - 1, prefill_tokens_cap)
    tokens = geometric(16, longest, 4 if quick else 5)
    room = min(prefill.max_model_len - 1, prefill_tokens_cap)  # context + chunk must fit both
    chunks = [min(32, longest)] if quick else [min(128, longest), min(512, longest)]
    contexts = (
        [_round_down(room // 4, block)] if quick else [_round_down(room // 8, block), _round_down(room // 3, block)]
    )
    return PrefillGrid(tokens, [(c, t) for c in contexts for t in chunks if c + t <= room])


def decode_grid(decode: LLMEngine, quick: bool, transfers: bool) -> DecodeGrid:
    """Batches up to ``max_num_seqs``, contexts the KV cache holds; transfers (``transfers``) of every head's KV up to
    ``MAX_TRANSFER_BYTES`` into half the cache."""
    block = decode.config.block_size
    decode_room = min(decode.max_model_len - 64, decode.block_manager.num_blocks * block // 2)
    contexts = [16, 64] if quick else [32, max(64, decode_room // 16), max(128, decode_room // 4)]
    max_seqs = decode.config.max_num_seqs
    batches = geometric(1, max_seqs, 3 if quick else max(2, max_seqs.bit_length()))
    bytes_per_block = decode.handoff_spec.bytes_per_block
    largest = max(1, min(MAX_TRANSFER_BYTES // bytes_per_block, decode.block_manager.num_blocks // 2))
    smallest = min(largest, max(1, 256 // block))  # one short request's KV
    transfer = geometric(smallest, largest, 3 if quick else 4) if transfers else []
    return DecodeGrid(contexts, batches, transfer)


# ---- the engines -------------------------------------------------------------------------------------------------


def pool_specs(
    config: ClusterConfig, tensor_parallel_size: int | None = None, expert_parallel_size: int | None = None
) -> tuple[WorkerSpec, WorkerSpec]:
    """The (prefill, decode) workers' specs as their processes resolve them, at ``tensor_parallel_size`` and
    ``expert_parallel_size`` (default: the pools' own, which must then agree: a profile is one degree's); colocated:
    one pool stands for both."""
    model_path = str(resolve_model_path(config.model.name))
    if tensor_parallel_size is not None or expert_parallel_size is not None:
        degree = {"expert_parallel_size": expert_parallel_size or 1}
        if tensor_parallel_size is not None:
            degree["tensor_parallel_size"] = tensor_parallel_size
        size = degree.get("tensor_parallel_size", config.pools.decode.tensor_parallel_size)
        try:
            check_degree(AutoConfig.from_pretrained(model_path), size, degree["expert_parallel_size"])
        except ValueError as exc:
            flag = "--" + degree_field(exc).replace("_", "-")
            raise ValueError(f"{flag}: {exc}") from None
        pools = {name: getattr(config.pools, name).model_copy(update=degree) for name in ("prefill", "decode")}
        config = config.model_copy(update={"pools": config.pools.model_copy(update=pools)})
    specs = config.worker_specs(model_path, ["tcp://127.0.0.1:1"], "127.0.0.1")  # router never contacted
    by_pool = {spec.pool: resolve_spec(spec) for spec in reversed(specs)}  # the first replica of each pool
    prefill = by_pool.get("prefill") or by_pool["decode"]
    decode = by_pool.get("decode") or by_pool["prefill"]
    degrees = sorted({_degree(prefill), _degree(decode)})
    if len(degrees) > 1:
        raise ValueError(
            f"pools.<pool>.tensor_parallel_size: the pools ask for (tensor, expert) degrees {degrees}, and a profile is "
            "one degree's; profile each with --tensor-parallel-size N (--expert-parallel-size E) and give "
            "`pdserve plan` every file"
        )
    return prefill, decode


def _degree(spec: WorkerSpec) -> tuple[int, int]:
    return spec.engine.tensor_parallel_size, spec.engine.expert_parallel_size


def measuring_engine(spec: WorkerSpec, group: TPGroup | None = None) -> LLMEngine:
    """The worker's engine (rank 0 of ``group`` at degree > 1) with prefix caching on (it changes no forward's cost),
    for the context points and shared decode batches; every prompt not meant to share is random."""
    engine = LLMEngine(dataclasses.replace(spec.engine, enable_prefix_caching=True), group)
    engine.warm_up()
    return engine


def device_name(engine: LLMEngine) -> str:
    device = engine.config.device
    return "cpu" if device == "cpu" else torch.cuda.get_device_name(torch.device(device))


def _prompt(rng: random.Random, engine: LLMEngine, length: int) -> list[int]:
    vocab = engine.model.config.vocab_size
    return [rng.randrange(min(100, vocab // 2), vocab) for _ in range(length)]


# ---- prefill -----------------------------------------------------------------------------------------------------


def _prefill_step(engine: LLMEngine, prompt: list[int]) -> tuple[float, int]:
    """Time the one step that prefills ``prompt``; returns (seconds, tokens the prefix cache supplied)."""
    rid = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0), prefill_only=True)
    start = time.perf_counter()
    outputs = engine.step()
    elapsed = time.perf_counter() - start
    request = engine.requests.get(rid)
    cached = request.num_cached_tokens if request is not None else 0
    done = request is not None and request.status == RequestStatus.PREFILLED
    engine.abort(rid)
    if not done:
        errors = [o.error for o in outputs if o.error]
        raise RuntimeError(f"a {len(prompt)}-token prefill did not finish in one step: {errors or 'chunked'}")
    return elapsed, cached


def _prefill_whole(engine: LLMEngine, prompt: list[int]) -> None:
    """Prefill a prompt in as many chunks as it takes, then release it: its full blocks stay in the prefix cache."""
    rid = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0), prefill_only=True)
    while engine.requests[rid].status != RequestStatus.PREFILLED:
        if not engine.step():
            raise RuntimeError("the context prefill stalled (KV cache too small?)")
    engine.release(rid)


def measure_prefill(engine: LLMEngine, grid: PrefillGrid, rng: random.Random, tick: Tick) -> list[PrefillPoint]:
    _prefill_step(engine, _prompt(rng, engine, grid.tokens[len(grid.tokens) // 2]))  # warm-up
    points = []
    for tokens in grid.tokens:
        times: list[float] = []
        while samples_needed(times, grid.repeats):
            times.append(_prefill_step(engine, _prompt(rng, engine, tokens))[0])
        points.append(PrefillPoint(tokens=tokens, context=0, seconds=statistics.median(times)))
        tick()
    for context, tokens in grid.context:
        prefix = _prompt(rng, engine, context)
        _prefill_whole(engine, prefix)
        runs: list[tuple[float, int]] = []
        while samples_needed([t for t, _ in runs], grid.repeats):
            runs.append(_prefill_step(engine, prefix + _prompt(rng, engine, tokens)))
        cached = min(hit for _, hit in runs)  # what the engine reused, whatever was intended
        computed = context + tokens - cached
        points.append(PrefillPoint(tokens=computed, context=cached, seconds=statistics.median(t for t, _ in runs)))
        tick()
    engine.block_manager.reset_prefix_cache()
    return points


# ---- decode ------------------------------------------------------------------------------------------------------


def _batch_cap(engine: LLMEngine, context: int, steps: int) -> int:
    """How many requests of ``context`` tokens sharing one prompt can decode ``steps`` tokens without preemption."""
    block = engine.config.block_size
    shared = (context - 1) // block  # full blocks the prefix cache shares (never the prompt's last token)
    own = blocks_for_tokens(context + steps, block) - shared
    return max(1, (engine.block_manager.num_blocks - shared) // own)


def measure_decode(engine: LLMEngine, grid: DecodeGrid, rng: random.Random, tick: Tick) -> list[DecodePoint]:
    points = []
    steps = len(grid.batches) * (max(grid.repeats, MAX_SAMPLES) + 1) + 8  # tokens each request must be able to decode
    for context in grid.contexts:
        context = min(context, engine.max_model_len - steps - 1)
        cap = _batch_cap(engine, context, steps)
        batches = sorted({b for b in grid.batches if b < cap} | {min(cap, max(grid.batches))})
        params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
        prompt = _prompt(rng, engine, context)
        first = engine.add_request(prompt, params.copy())
        while not engine.requests[first].output_token_ids:  # its blocks cached before the others arrive
            engine.step()
        ids = [first] + [engine.add_request(prompt, params.copy()) for _ in range(max(batches) - 1)]
        while any(not engine.requests[rid].output_token_ids for rid in ids):
            engine.step()
        preemptions = engine.scheduler.num_preemptions
        for batch in sorted(batches, reverse=True):
            for rid in ids[batch:]:
                engine.abort(rid)
            ids = ids[:batch]
            engine.step()  # warm-up at this size
            times: list[float] = []
            contexts: list[int] = []
            while samples_needed(times, grid.repeats):
                contexts.append(sum(engine.requests[rid].num_tokens for rid in ids))
                start = time.perf_counter()
                outputs = engine.step()
                times.append(time.perf_counter() - start)
                if len(outputs) != batch or any(o.error for o in outputs):
                    raise RuntimeError(f"a decode step of {batch} requests returned {len(outputs)} outputs")
            points.append(DecodePoint(batch, round(statistics.mean(contexts)), statistics.median(times)))
            tick()
        if engine.scheduler.num_preemptions != preemptions:
            raise RuntimeError("the decode batch was preempted while timed: the KV cache is too small for the grid")
        for rid in ids:
            engine.abort(rid)
        tick(len(grid.batches) - len(batches))  # sizes the KV cache cannot hold at this context
    engine.block_manager.reset_prefix_cache()
    return points


# ---- the whole profile -------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Job:
    """What one pool's measuring process is asked (picklable: it crosses to the ranks' processes)."""

    spec: WorkerSpec
    quick: bool
    seed: int
    progress: bool
    transfers: bool = False  # decode: also time KV transfers into this engine (disaggregated)


def prefill_part(job: Job, group: TPGroup | None = None) -> dict:
    """The prefill points and what the profile records of the prefill engine, as plain data."""
    engine = measuring_engine(job.spec, group)
    try:
        grid = prefill_grid(engine, job.quick)
        with tqdm(total=grid.num_measurements, desc="profiling prefill", unit="point", disable=not job.progress) as bar:
            points = measure_prefill(engine, grid, random.Random(job.seed), bar.update)
        engine.check_no_leaks()
        return {
            "points": [dataclasses.asdict(p) for p in points],
            "repeats": grid.repeats,
            "dtype": engine.config.dtype,
            "device": device_name(engine),
            "block_size": engine.config.block_size,
            "kv_bytes_per_token": engine.handoff_spec.bytes_per_token,
            "num_kv_heads": engine.handoff_spec.num_kv_heads,
            "max_batch_tokens": engine.config.max_batch_tokens,
        }
    finally:
        engine.close()


def decode_part(job: Job, group: TPGroup | None = None) -> dict:
    """The decode (and transfer) points and what the profile records of the decode engine, as plain data."""
    engine = measuring_engine(job.spec, group)
    try:
        grid = decode_grid(engine, job.quick, job.transfers)
        rng = random.Random(job.seed + 1)
        with tqdm(total=grid.num_measurements, desc="profiling decode", unit="point", disable=not job.progress) as bar:
            points = measure_decode(engine, grid, rng, bar.update)
            backend, note = "none", "transfer: colocated, no KV moves"
            transfer: list[TransferPoint] = []
            if grid.transfer_blocks:
                backend, note, transfer = measure_transfer(
                    engine, job.spec, grid.transfer_blocks, grid.repeats, bar.update
                )
        engine.check_no_leaks()
        return {
            "points": [dataclasses.asdict(p) for p in points],
            "transfer_points": [dataclasses.asdict(p) for p in transfer],
            "backend": backend,
            "transfer_note": note,
            "kv_blocks": engine.block_manager.num_blocks,
            "max_num_seqs": engine.config.max_num_seqs,
        }
    finally:
        engine.close()


PARTS = {"prefill": prefill_part, "decode": decode_part}


def _rank_main(rank: int, size: int, store_path: str, payload: tuple[str, Job]) -> dict:
    """One rank of a measured engine at degree > 1 (``engine.tp_launch``): rank 0 measures; the others serve it."""
    part, job = payload
    spec = dataclasses.replace(job.spec, tp_rendezvous=store_path)
    if rank > 0:
        return {"ended": TPRank(spec, rank).wait(PART_TIMEOUT_S)}
    return PARTS[part](dataclasses.replace(job, spec=spec), join_group(spec, 0))


def measure_part(part: str, job: Job) -> dict:
    """``part`` measured here at degree 1; by a local process per rank at more ranks, rank 0 measuring."""
    size = job.spec.engine.ranks
    if size == 1:
        return PARTS[part](job)
    return run_ranks(_rank_main, size, (part, job), timeout_s=PART_TIMEOUT_S)[0]


def profile_cluster(
    config: ClusterConfig,
    quick: bool = False,
    progress: bool = True,
    seed: int = 0,
    tensor_parallel_size: int | None = None,
    expert_parallel_size: int | None = None,
) -> Profile:
    """Measure this machine with ``config``'s workers (at ``tensor_parallel_size``, default the pools') and fit the
    curves; the caller saves the ``Profile``. The prefill engine is measured, then closed, then the decode engine."""
    started = time.monotonic()
    prefill_spec, decode_spec = pool_specs(config, tensor_parallel_size, expert_parallel_size)
    transfers = config.mode == "disaggregated"
    prefill_run = measure_part("prefill", Job(prefill_spec, quick, seed, progress))
    decode_run = measure_part("decode", Job(decode_spec, quick, seed, progress, transfers))
    prefill = [PrefillPoint(**p) for p in prefill_run["points"]]
    decode = [DecodePoint(**p) for p in decode_run["points"]]
    transfer = [TransferPoint(**p) for p in decode_run["transfer_points"]]
    fits: list[str] = []  # each fit's quality, for the notes

    def fit(name: str, points: list, features: list[str], *variables: str) -> Fit:
        rows = [{v: float(getattr(p, v)) for v in variables} for p in points]
        fitted, quality = fit_points(features, rows, [p.seconds for p in points])
        fits.append(f"{name} fit: {quality.describe()}")
        return fitted

    prefill_fit = fit("prefill", prefill, PREFILL_FEATURES, "tokens", "context")
    decode_fit = fit("decode", decode, DECODE_FEATURES, "batch", "context_tokens")
    transfer_fit = fit("transfer", transfer, TRANSFER_FEATURES, "num_bytes") if transfer else None
    degree, experts = _degree(prefill_spec)
    notes = "; ".join(
        [
            f"measured by pdserve profile in {time.monotonic() - started:.0f} s",
            f"tensor_parallel_size {degree}, expert_parallel_size {experts}"
            + (" (ranks as local processes)" if prefill_spec.engine.ranks > 1 else ""),
            f"torch threads{' per rank' if prefill_spec.engine.ranks > 1 else ''} prefill {prefill_spec.engine.torch_threads or 'default'}"
            f", decode {decode_spec.engine.torch_threads or 'default'}",
            f"devices prefill {prefill_spec.engine.device}, decode {decode_spec.engine.device}",
            f"median of >= {prefill_run['repeats']} timings per point",
            *fits,
            decode_run["transfer_note"],
        ]
    )
    return Profile(
        model=config.model.name,
        dtype=prefill_run["dtype"],
        device=prefill_run["device"],
        backend=decode_run["backend"],
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        block_size=prefill_run["block_size"],
        kv_bytes_per_token=prefill_run["kv_bytes_per_token"],
        num_kv_heads=prefill_run["num_kv_heads"],
        kv_blocks=decode_run["kv_blocks"],
        max_batch_tokens=prefill_run["max_batch_tokens"],
        max_num_seqs=decode_run["max_num_seqs"],
        prefill_points=prefill,
        decode_points=decode,
        transfer_points=transfer,
        prefill_fit=prefill_fit,
        decode_fit=decode_fit,
        transfer_fit=transfer_fit,
        notes=notes,
        tensor_parallel_size=degree,
        expert_parallel_size=experts,
    )
