"""How many KV blocks a GPU engine allocates: measured, not guessed (vLLM's rule, our code).

A hand-written budget is too small (the GPU idles) or too large (a long batch runs out of memory mid-step, failing
every request in it). So on CUDA, unless ``kv_blocks`` or ``kv_cache_memory_bytes`` is given, the engine measures:
``KVMemoryPlanner.start`` snapshots the device before the weights load (and fails at once when ``total x
gpu_memory_utilization``, this engine's share, is not free); ``plan`` then profiles the largest steps on a small
cache (``_profile``, ``_graph_pool``) and ``plan_kv_blocks`` leaves the KV ``total x utilization - weights - peak -
non-torch growth - scratch - graph pool - NCCL - reserve``, an error naming the knobs if under one max_model_len
request. The arithmetic is pure and the device is read through ``DeviceMemory``, so tests run it all on the CPU.
"""

from __future__ import annotations

import copy
import gc
import logging
import uuid
from dataclasses import asdict, dataclass
from typing import Protocol

import torch
from transformers import PreTrainedModel

from engine.attention import select_backend
from engine.blocks import blocks_for_tokens
from engine.config import EngineConfig
from engine.decode_graphs import DecodeGraphs, StaticStep, uses_decode_graphs
from engine.kv_cache import KVCache, KVSpec
from engine.model_runner import ModelRunner
from engine.request import MAX_LOGPROBS, Request, RequestTiming, SamplingParams
from engine.sampler import Sampler
from engine.scheduler import ScheduledChunk

logger = logging.getLogger(__name__)

GIB = 1024**3
# NCCL buffers per pair group (2 ranks, p2p channels, SIMPLE/LL/LL128 buffers, cuMem's 2 MiB granularity): an
# estimate, not yet measured on the GPUs it runs on
NCCL_BYTES_PER_PEER = 512 * 1024**2
SEGMENT_BYTES = 2 * 1024**2  # the caching allocator's small-block segment: what one graph's kept output can pin
# non-torch growth beyond what the CUDA context, cuBLAS and NCCL take (about 1 GiB) suggests another process on the
# GPU allocated while this engine loaded and profiled, which the budget cannot tell from its own
NON_TORCH_WARN_BYTES = 2 * GIB


class MemoryPlanError(ValueError):
    """The measured memory cannot hold a usable KV cache; the message names the setting to change."""


class DeviceMemory(Protocol):
    """The readings the planner needs, for one device (``torch.cuda``'s functions of the same names)."""

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of the whole device, every process included."""
        ...

    def memory_allocated(self) -> int: ...

    def max_memory_allocated(self) -> int: ...

    def memory_reserved(self) -> int: ...

    def reset_peak_memory_stats(self) -> None: ...

    def synchronize(self) -> None: ...

    def empty_cache(self) -> None: ...


class CudaMemory:
    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)

    def mem_get_info(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)

    def memory_allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def max_memory_allocated(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def memory_reserved(self) -> int:
        return int(torch.cuda.memory_reserved(self.device))

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()


@dataclass(frozen=True, slots=True)
class MemorySnapshot:
    free_bytes: int
    total_bytes: int
    allocated_bytes: int  # torch tensors alive
    reserved_bytes: int  # torch's caching allocator's segments (allocated plus cached)

    @property
    def non_torch_bytes(self) -> int:
        """Device memory in use that torch's allocator does not hold (CUDA context, libraries, other processes)."""
        return self.total_bytes - self.free_bytes - self.reserved_bytes


def take_snapshot(memory: DeviceMemory) -> MemorySnapshot:
    """A reading with the device idle and torch's cached, unused segments returned to the driver."""
    memory.synchronize()
    gc.collect()
    memory.empty_cache()
    free, total = memory.mem_get_info()
    return MemorySnapshot(free, total, memory.memory_allocated(), memory.memory_reserved())


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """Where one engine's share of the GPU goes; every figure in bytes."""

    total_bytes: int  # the device's memory
    utilization: float  # gpu_memory_utilization: this engine's share of total_bytes
    weights_bytes: int
    peak_activation_bytes: int  # the largest step's transient tensors (forward and sampler)
    non_torch_bytes: int  # grown outside torch since the engine started (CUDA context, cuBLAS, NCCL)
    scratch_bytes: int  # buffers kept between steps, at their bound (the decode gather buffer)
    graph_pool_bytes: int  # the decode graphs' memory pool (their captured steps' tensors), estimated by profiling
    nccl_bytes: int  # NCCL communicators' buffers, per expected pair group
    reserve_bytes: int  # fixed: what loads after the profile (lazily loaded kernels, new streams' workspaces)
    kv_bytes: int  # what is left for the KV cache
    bytes_per_block: int
    num_blocks: int  # blocks the block manager hands out
    extra_blocks: int  # blocks the KV cache allocates beyond those (the padding sink)

    @property
    def requested_bytes(self) -> int:
        return int(self.total_bytes * self.utilization)

    def summary(self) -> str:

        def gib(value: int) -> str:
            return f"{value / GIB:.2f}"

        return (
            f"KV memory plan: {gib(self.requested_bytes)} GiB = {self.utilization:g} x {gib(self.total_bytes)} GiB; "
            f"weights {gib(self.weights_bytes)}, peak activation {gib(self.peak_activation_bytes)}, "
            f"non-torch {gib(self.non_torch_bytes)}, scratch {gib(self.scratch_bytes)}, graph pool "
            f"{gib(self.graph_pool_bytes)}, NCCL {gib(self.nccl_bytes)}, reserve {gib(self.reserve_bytes)}, "
            f"KV {gib(self.kv_bytes)} GiB -> {self.num_blocks} blocks of {self.bytes_per_block} bytes"
        )

    def as_dict(self) -> dict[str, int | float]:
        return asdict(self)


def check_share(total_bytes: int, free_bytes: int, utilization: float) -> int:
    """This engine's share of the GPU (``total x utilization``) in bytes; an error when that much is not free."""
    requested = int(total_bytes * utilization)
    if free_bytes < requested:
        raise MemoryPlanError(
            f"gpu_memory_utilization={utilization:g} asks for {requested / GIB:.2f} GiB of the GPU's "
            f"{total_bytes / GIB:.2f} GiB, but only {free_bytes / GIB:.2f} GiB were free when this engine "
            "started (other processes hold the rest): lower gpu_memory_utilization, or set kv_memory_mb"
        )
    return requested


def plan_kv_blocks(
    *,
    total_bytes: int,
    free_at_start_bytes: int,
    utilization: float,
    weights_bytes: int,
    peak_activation_bytes: int,
    non_torch_bytes: int,
    scratch_bytes: int,
    bytes_per_block: int,
    min_blocks: int,
    extra_blocks: int = 0,
    graph_pool_bytes: int = 0,
    nccl_bytes: int = 0,
    reserve_bytes: int = 0,
) -> MemoryPlan:
    """The budget arithmetic. ``min_blocks``: what one ``max_model_len`` request needs; fewer is an error (the engine
    would refuse requests its own config admits)."""
    requested = check_share(total_bytes, free_at_start_bytes, utilization)
    held = weights_bytes + peak_activation_bytes + non_torch_bytes + scratch_bytes
    kv_bytes = requested - held - graph_pool_bytes - nccl_bytes - reserve_bytes
    num_blocks = kv_bytes // bytes_per_block - extra_blocks if kv_bytes > 0 else 0
    if num_blocks < min_blocks:
        raise MemoryPlanError(
            f"no room for the KV cache: gpu_memory_utilization={utilization:g} x {total_bytes / GIB:.2f} GiB = "
            f"{requested / GIB:.2f} GiB, less weights {weights_bytes / GIB:.2f}, peak activation "
            f"{peak_activation_bytes / GIB:.2f}, non-torch {non_torch_bytes / GIB:.2f}, scratch "
            f"{scratch_bytes / GIB:.2f}, graph pool {graph_pool_bytes / GIB:.2f}, NCCL {nccl_bytes / GIB:.2f} and "
            f"reserve {reserve_bytes / GIB:.2f} GiB leaves {kv_bytes / GIB:.2f} GiB = {max(num_blocks, 0)} blocks of "
            f"{bytes_per_block} bytes, fewer than the {min_blocks} one max_model_len request needs: raise "
            "gpu_memory_utilization, lower max_model_len / max_num_seqs / max_batch_tokens, or set kv_memory_mb"
        )
    return MemoryPlan(
        total_bytes=total_bytes,
        utilization=utilization,
        weights_bytes=weights_bytes,
        peak_activation_bytes=peak_activation_bytes,
        non_torch_bytes=non_torch_bytes,
        scratch_bytes=scratch_bytes,
        graph_pool_bytes=graph_pool_bytes,
        nccl_bytes=nccl_bytes,
        reserve_bytes=reserve_bytes,
        kv_bytes=kv_bytes,
        bytes_per_block=bytes_per_block,
        num_blocks=num_blocks,
        extra_blocks=extra_blocks,
    )


def needs_measured_budget(config: EngineConfig) -> bool:
    """A CUDA engine given neither ``kv_blocks`` nor ``kv_cache_memory_bytes`` (explicit settings always win)."""
    return config.device.startswith("cuda") and config.kv_blocks is None and config.kv_cache_memory_bytes is None


class KVMemoryPlanner:
    """Measures one engine's memory: ``start`` before the weights load, ``plan`` after."""

    def __init__(self, config: EngineConfig, memory: DeviceMemory) -> None:
        self.config = config
        self.memory = memory
        self.at_start = take_snapshot(memory)
        # fail before spending minutes loading weights
        check_share(self.at_start.total_bytes, self.at_start.free_bytes, config.gpu_memory_utilization)

    @classmethod
    def start(cls, config: EngineConfig, memory: DeviceMemory | None = None) -> KVMemoryPlanner | None:
        """A planner when this engine sizes its KV from measured memory, else None."""
        if not needs_measured_budget(config):
            return None
        return cls(config, memory if memory is not None else CudaMemory(config.device))

    def for_config(self, config: EngineConfig) -> KVMemoryPlanner:
        """This measurement from before the weights loaded, planned for another config of the same weights (a worker
        switching role, its old KV cache freed)."""
        planner = copy.copy(self)
        planner.config = config
        check_share(self.at_start.total_bytes, self.at_start.free_bytes, config.gpu_memory_utilization)
        return planner

    def plan(
        self, model: PreTrainedModel, spec: KVSpec, max_model_len: int, extra_scratch_bytes: int = 0
    ) -> MemoryPlan:
        """Profile the loaded model and budget the rest; logs the plan. ``extra_scratch_bytes``: other buffers the
        engine keeps between steps (counted like the runner's gather buffer)."""
        memory, config = self.memory, self.config
        memory.synchronize()
        weights = memory.memory_allocated() - self.at_start.allocated_bytes
        try:
            profile = self._profile(model, spec, max_model_len)
        except torch.OutOfMemoryError as exc:
            raise MemoryPlanError(
                f"the profiling step ({config.max_batch_tokens} tokens in prompts of up to max_model_len="
                f"{max_model_len}, {config.max_num_seqs} decode rows) ran out of GPU memory after the weights took "
                f"{weights / GIB:.2f} GiB: lower max_model_len, max_batch_tokens or max_num_seqs ({exc})"
            ) from exc
        after = take_snapshot(memory)
        # torch memory the profile left behind once its runner and cache are gone (cuBLAS workspaces, allocated on
        # first use and kept): the engine's first steps will allocate it too
        peak = profile.peak + max(0, after.allocated_bytes - self.at_start.allocated_bytes - weights)
        non_torch = max(0, after.non_torch_bytes - self.at_start.non_torch_bytes)
        if non_torch > NON_TORCH_WARN_BYTES:
            logger.warning(
                "memory outside torch grew by %.2f GiB while this engine loaded and profiled; if another process on "
                "this GPU allocated meanwhile, it was counted against this engine's KV: start engines that share a "
                "GPU one at a time, or set kv_memory_mb",
                non_torch / GIB,
            )
        plan = plan_kv_blocks(
            total_bytes=self.at_start.total_bytes,
            free_at_start_bytes=self.at_start.free_bytes,
            utilization=config.gpu_memory_utilization,
            weights_bytes=weights,
            peak_activation_bytes=peak,
            non_torch_bytes=non_torch,
            scratch_bytes=profile.scratch_bound + extra_scratch_bytes,
            bytes_per_block=spec.bytes_per_block,
            min_blocks=blocks_for_tokens(max_model_len, spec.block_size),
            extra_blocks=profile.extra_blocks,
            graph_pool_bytes=profile.graph_pool,
            nccl_bytes=config.nccl_peers * NCCL_BYTES_PER_PEER,
            reserve_bytes=config.memory_reserve_bytes,
        )
        logger.info("%s", plan.summary())
        return plan

    def _profile(self, model: PreTrainedModel, spec: KVSpec, max_model_len: int) -> _Profile:
        """The largest steps the scheduler can build, on a small cache whose block ids repeat: a full prefill step
        of ``max_batch_tokens`` in prompts of up to ``max_model_len`` with prompt logprobs; a decode step of
        ``max_num_seqs`` rows at ``max_model_len`` with top-p and logprobs (prefill-only engines run such rows too: a
        prompt's last token after a cached prefix); with decode graphs, their static steps at the largest keys."""
        config = self.config
        decode_rows = min(config.max_num_seqs, config.max_batch_tokens)
        cache_tokens = min(config.max_batch_tokens, max_model_len)  # block ids repeat across the fake requests
        cache = KVCache(spec, blocks_for_tokens(cache_tokens, spec.block_size) + 1, config.device)
        extra_blocks = cache.kv[0].shape[1] - cache.num_blocks
        runner = ModelRunner(model, cache, select_backend(config.attention_backend, config.device, model.dtype))
        scratch_bound = runner.limit_scratch(config.max_num_seqs, max_model_len)
        sampler = Sampler((), runner.device)
        context = _fake_tokens(max_model_len, int(runner.lm_head.out_features))
        table = [i % cache.num_blocks for i in range(blocks_for_tokens(max_model_len, spec.block_size))]
        prompt_params = SamplingParams(max_tokens=1, prompt_logprobs=MAX_LOGPROBS)
        prefill_step = [
            ScheduledChunk(_fake_request(context, table, prompt_params), max_model_len - length, length)
            for length in prefill_lengths(config.max_batch_tokens, max_model_len)
        ]
        decode_params = SamplingParams(max_tokens=1, top_p=0.9, logprobs=MAX_LOGPROBS)
        decode = [_fake_request(context, table, decode_params) for _ in range(decode_rows)]
        steps = [prefill_step, [ScheduledChunk(request, max_model_len - 1, 1) for request in decode]]
        peak = 0
        for chunks in steps:
            peak = max(peak, self._measure_step(runner, sampler, chunks))
        graph_pool = self._graph_pool(runner, max_model_len) if uses_decode_graphs(config) else 0
        del runner, cache, sampler, steps, prefill_step
        return _Profile(peak, extra_blocks, scratch_bound, graph_pool)

    def _graph_pool(self, runner: ModelRunner, max_model_len: int) -> int:
        """A captured step allocates in the pool what its eager run does, and graphs sharing the pool reuse each
        other's freed blocks, leaving each graph's output. So: the static step's largest peak at its extreme keys
        (run eagerly, all rows padding), plus each graph's output rounded up to an allocator segment."""
        config, memory = self.config, self.memory
        graphs = DecodeGraphs(runner, config.max_num_seqs, max_model_len, StaticStep.EAGER)
        keys = graphs.planned_keys()  # (batch, context blocks)
        widest = max(blocks for _, blocks in keys)
        largest = max(batch for batch, _ in keys)
        extremes = {
            (max(b for b, w in keys if w == widest), widest),
            (largest, max(w for b, w in keys if b == largest)),
        }
        peak = 0
        for batch, blocks in sorted(extremes):
            memory.synchronize()
            memory.reset_peak_memory_stats()
            before = memory.memory_allocated()
            graphs.run_padding_step(batch, blocks)
            memory.synchronize()
            peak = max(peak, memory.max_memory_allocated() - before)
        outputs = sorted((graphs.output_bytes(batch) for batch, _ in keys), reverse=True)[: graphs.max_graphs]
        graphs.close()
        del graphs
        return peak + sum(-(-n // SEGMENT_BYTES) * SEGMENT_BYTES for n in outputs)

    def _measure_step(self, runner: ModelRunner, sampler: Sampler, chunks: list[ScheduledChunk]) -> int:
        """Torch's peak in this step above what it holds after: the transient tensors (what stays, the gather buffer
        and cuBLAS workspaces, is counted elsewhere). Runs forward, prompt scores and sampler, as ``LLMEngine.step``."""
        memory = self.memory
        memory.synchronize()
        memory.reset_peak_memory_stats()
        logits, _ = runner.execute(chunks)
        result = sampler.sample(logits, [c.request for c in chunks if c.samples], runner.score_prompts(chunks))
        del logits, result
        memory.synchronize()
        return max(0, memory.max_memory_allocated() - memory.memory_allocated())


def prefill_lengths(max_batch_tokens: int, max_model_len: int) -> list[int]:
    """A full prefill step's prompts: ``max_batch_tokens`` tokens as prompts of ``max_model_len`` and the rest."""
    whole, rest = divmod(max_batch_tokens, max_model_len)
    return [max_model_len] * whole + ([rest] if rest else [])


@dataclass(frozen=True, slots=True)
class _Profile:
    peak: int  # peak activation bytes of the largest steps
    extra_blocks: int  # the KV cache's blocks beyond the block manager's
    scratch_bound: int
    graph_pool: int  # the decode graphs' pool, 0 without graphs


def _fake_tokens(length: int, vocab_size: int) -> list[int]:
    """Token ids of a profiling request: only the length matters to memory."""
    return [(i * 7919) % vocab_size for i in range(length)]


def _fake_request(token_ids: list[int], block_ids: list[int], params: SamplingParams) -> Request:
    """A request as the scheduler would hand one over, its prompt fully allocated (on repeated block ids)."""
    request = Request(f"memory-profile-{uuid.uuid4().hex[:8]}", token_ids, params, RequestTiming(0.0))
    request.block_ids = block_ids
    return request
