"""The engine's parts on its device (model, KV cache, runner, sampler), built once for ``LLMEngine``'s step loop.

The build order is the memory plan's: the planner measures from before the model loads, the KV spec comes from the
loaded model's config, the decode graphs' scratch is counted before the cache is sized, and the runner's scratch is
then limited to the bound the plan counted (``engine.memory``, ``engine.decode_graphs``).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from engine.attention import register_paged_attention, select_backend
from engine.blocks import kv_blocks_for
from engine.compile_cache import keep_linear_forms, kept_linear_forms, model_fingerprint, runtime_fields
from engine.config import DEFAULT_CPU_KV_BYTES, EngineConfig, resolve_dtype
from engine.cpu_linear import BUCKETS, Form, tune_cpu_linears
from engine.decode_graphs import decode_graphs_for, graph_scratch_bytes, uses_compiled_decode
from engine.kv_cache import KVCache, KVSpec
from engine.memory import KVMemoryPlanner, MemoryPlan, needs_measured_budget
from engine.model_loader import load_model
from engine.model_probe import ModelAttention, probe_model
from engine.model_runner import EngineRunner, ModelRunner
from engine.sampler import Sampler
from engine.tensor_parallel import HeadSplit, StepChannel, TPGroup, head_split
from engine.tp_shard import cache_kv_heads

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineParts:
    config: EngineConfig  # with ``dtype: auto`` resolved for the device
    model: Any
    tokenizer: Any
    max_model_len: int
    kv_spec: KVSpec
    attention: ModelAttention  # what each layer's attention needs (engine.model_probe)
    memory_plan: MemoryPlan | None  # None unless measured (CUDA, no explicit KV budget)
    kv_cache: KVCache
    runner: EngineRunner  # ModelRunner here; the planner's simulated workers give one that computes nothing
    eos_token_ids: set[int]
    vocab_size: int  # the logits' width (may exceed the tokenizer's)
    sampler: Sampler
    memory_planner: KVMemoryPlanner | None = None  # measured from before the weights loaded (CUDA, no KV budget)


# what the loaded weights depend on: a config that differs in any of these needs another load, not ``rebuild``
WEIGHT_FIELDS = ("model", "dtype", "device", "tensor_parallel_size", "expert_parallel_size", "cpu_linear_tuning")


def build_engine_parts(config: EngineConfig, group: TPGroup | None = None) -> EngineParts:
    """With a tensor-parallel ``group``: this rank's shard, KV heads and cache; rank 0 announces each step to the
    others, which project nothing to the vocabulary."""
    config = _resolved(config)
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    planner = KVMemoryPlanner.start(config)  # CUDA, no explicit KV budget: measure from here (engine.memory)
    if (group.size if group else 1) != config.ranks:
        raise ValueError(f"the engine has {config.ranks} ranks, the group {group and group.size}")
    model, tokenizer = load_model(
        config.model,
        config.dtype,
        config.device,
        register_paged_attention(),
        group,
        config.tensor_parallel_size,
        config.expert_parallel_size,
    )
    if model.device.type == "cpu" and config.cpu_linear_tuning:  # decode's few rows: the fastest product here
        _tune_linears(model, config, group)
    hf_config = model.config
    attention = probe_model(model, hf_config.num_hidden_layers)  # the KV layout and features, from the model itself
    size = group.size if group else 1
    if size == 1:  # the heads the layers pass (configs name them differently, or not at all)
        split = head_split(attention.layers[0].query_heads, attention.num_kv_heads, 1, 0)
    else:  # a shard cut by the model's own plan (engine.tp_shard.tp_plan), its heads named by its config
        assert group is not None  # the heads the shard was cut by (a latent row: one KV head, whole on every rank)
        heads = hf_config.num_attention_heads, cache_kv_heads(hf_config)
        split = head_split(*heads, size, group.rank, config.tensor_parallel_size)
    return _place(config, group, model, tokenizer, attention, split, planner)


def rebuild_engine_parts(parts: EngineParts, config: EngineConfig) -> EngineParts:
    """The same loaded weights under another config (a worker switching role keeps its model): a new KV cache, runner
    and sampler sized by ``config``. The caller has let go of ``parts``' cache (``check_same_weights`` first)."""
    config = check_same_weights(parts.config, config)
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    planner: KVMemoryPlanner | None
    if parts.memory_planner is not None and needs_measured_budget(config):
        planner = parts.memory_planner.for_config(config)  # measured from before the weights: their share stands
    else:
        planner = KVMemoryPlanner.start(config)  # the loaded weights count as memory in use
    split = parts.runner.head_split
    assert split is not None  # every runner this module builds has one
    return _place(config, None, parts.model, parts.tokenizer, parts.attention, split, planner)


def check_same_weights(loaded: EngineConfig, config: EngineConfig) -> EngineConfig:
    """``config`` resolved, if the weights loaded for ``loaded`` serve it; else ValueError naming the first field the
    weights depend on (``WEIGHT_FIELDS``) that differs: that takes a load."""
    config = _resolved(config)
    for name in WEIGHT_FIELDS:
        if getattr(config, name) != getattr(loaded, name):
            raise ValueError(
                f"{name}: {getattr(config, name)!r}, but the weights were loaded for {getattr(loaded, name)!r}; the "
                "same weights serve only the same value"
            )
    if config.ranks > 1:
        raise ValueError(
            f"{'tensor' if config.tensor_parallel_size > 1 else 'expert'}_parallel_size: a worker of several ranks is "
            "not rebuilt in place (its ranks are not)"
        )
    return config


def _resolved(config: EngineConfig) -> EngineConfig:
    if config.dtype == "auto":
        return dataclasses.replace(config, dtype=resolve_dtype(config.dtype, config.device))
    return config


def _place(
    config: EngineConfig,
    group: TPGroup | None,
    model: Any,
    tokenizer: Any,
    attention: ModelAttention,
    split: HeadSplit,
    planner: KVMemoryPlanner | None,
) -> EngineParts:
    """Everything but the weights: the KV layout and cache, the runner and its static steps, the sampler."""
    hf_config = model.config
    max_model_len = config.max_model_len or int(getattr(hf_config, "max_position_embeddings", 2048))
    kv_spec = KVSpec.for_model(
        architecture=hf_config.model_type,
        model_dtype=model.dtype,
        num_layers=hf_config.num_hidden_layers,
        num_kv_heads=attention.num_kv_heads,
        head_dim=attention.head_dim,
        block_size=config.block_size,
        kv_cache_dtype=config.kv_cache_dtype,
        kv_layout="latent" if attention.latent_width else "heads",
    )
    if attention.num_kv_heads != split.kv_heads:
        raise ValueError(f"model: {hf_config.model_type!r} caches {attention.num_kv_heads} KV heads, expected {split}")
    graph_scratch = graph_scratch_bytes(config, kv_spec, max_model_len)  # comes out of the KV budget
    memory_plan = planner.plan(model, kv_spec, max_model_len, graph_scratch) if planner else None
    if memory_plan is not None:
        num_blocks = memory_plan.num_blocks
    else:
        kv_bytes = config.kv_cache_memory_bytes or DEFAULT_CPU_KV_BYTES
        num_blocks = kv_blocks_for(kv_bytes, kv_spec.bytes_per_block, config.kv_blocks)
    kv_cache = KVCache(kv_spec, num_blocks, config.device)
    backend = select_backend(config.attention_backend, config.device, model.dtype, attention.features)
    runner = ModelRunner(model, kv_cache, backend)
    runner.final_logit_softcap = attention.final_logit_softcap
    runner.plain_head = attention.plain_head
    runner.sliding_windows = frozenset(layer.sliding_window for layer in attention.layers if layer.sliding_window)
    runner.head_split = split
    if group is not None and group.size > 1:
        runner.step_channel = StepChannel(group) if group.rank == 0 else None
        runner.projects_logits = group.rank == 0
        runner.tp_group = group
    # every rank holds the same static steps (captured or compiled with the ranks' all-reduces inside, in the same
    # order), and takes one exactly when rank 0 does: the step is the same on every rank
    runner.decode_graphs = decode_graphs_for(runner, config, max_model_len)
    runner.limit_scratch(config.max_num_seqs, max_model_len)  # the bound the KV plan counted
    if group is not None and group.size > 1:
        group.barrier()  # every shard loaded before rank 0 announces a first step
    eos_token_ids = _eos_ids(model, tokenizer)
    vocab_size = int(runner.lm_head.out_features)
    sampler = Sampler(eos_token_ids, config.device)
    return EngineParts(
        config,
        model,
        tokenizer,
        max_model_len,
        kv_spec,
        attention,
        memory_plan,
        kv_cache,
        runner,
        eos_token_ids,
        vocab_size,
        sampler,
        planner,
    )


def _tune_linears(model: torch.nn.Module, config: EngineConfig, group: TPGroup | None) -> None:
    """Time the linears' forms (engine.cpu_linear); with a compiled decode step kept on disk, time them once per
    machine and model and take the kept forms after that (the step's graphs were traced with them)."""
    keep = uses_compiled_decode(config) and (group is None or group.size == 1)
    fields = runtime_fields() | {"model": model_fingerprint(model), "threads": torch.get_num_threads()} if keep else {}
    fields.pop("engine_source", None)  # the forms are timed, not traced
    kept = kept_linear_forms(fields) if keep else None
    try:
        forms = tuple(Form(f) for f in kept) if kept else None
    except ValueError:  # not forms of this version: timed again
        forms = kept = None
    table = tune_cpu_linears(model, kept=forms)
    if table is None:
        return
    if keep and kept is None:
        keep_linear_forms(fields, [f.value for f in table.forms])
    logger.info(
        "CPU linears by rows %s: %s (%s)",
        BUCKETS,
        [f.value for f in table.forms],
        f"pass ms {table.pass_ms}" if table.pass_ms else "as timed at an earlier start",
    )


def _eos_ids(model: torch.nn.Module, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
