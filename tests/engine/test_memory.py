"""KV sizing from measured GPU memory (engine/memory.py), the bounded decode gather buffer, and loading in the
requested dtype on the requested device.

There is no GPU here: the CUDA path runs for real on the CPU (the tiny model is loaded, the profiling steps run
through the real runner and sampler, the engine serves on the planned blocks) and only the memory readings come from
``FakeMemory``, a device whose numbers the test sets, so every expected figure below is computed by hand.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import engine.engine_parts as engine_parts
import engine.memory as engine_memory
from engine.config import EngineConfig
from engine.decode_graphs import uses_decode_graphs
from engine.llm_engine import LLMEngine
from engine.memory import (
    SEGMENT_BYTES,
    KVMemoryPlanner,
    MemoryPlanError,
    needs_measured_budget,
    plan_kv_blocks,
    prefill_lengths,
)
from engine.model_loader import load_model
from engine.request import SamplingParams

MIB = 1024 * 1024
# the tiny llama (engine/tiny_model.py): 3 layers, 2 KV heads of 16 dims; float32 on the CPU
BLOCK_BYTES = 2 * 3 * 2 * 16 * 4 * 16  # K and V x layers x KV heads x head dim x 4 bytes x 16 tokens = 12288
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


class FakeMemory:
    """A device whose readings the test sets: ``total`` bytes, ``others`` of them used by other processes and the
    CUDA context. ``load(n)`` is torch allocating n bytes for good (the weights), ``grow_non_torch(n)`` memory
    taken outside torch (cuBLAS handles); each profiling step, on its peak-stats reset, is given the next of
    ``step_activations`` as transient tensors on top of what torch holds."""

    def __init__(self, total: int, others: int, step_activations: list[int]) -> None:
        self.total = total
        self.free = total - others
        self.allocated = 0
        self.step_activations = list(step_activations)
        self.steps = 0
        self.transient = 0

    def load(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.free -= nbytes

    def grow_non_torch(self, nbytes: int) -> None:
        self.free -= nbytes

    def mem_get_info(self) -> tuple[int, int]:
        return self.free, self.total

    def memory_allocated(self) -> int:
        return self.allocated

    def max_memory_allocated(self) -> int:
        return self.allocated + self.transient

    def memory_reserved(self) -> int:
        return self.allocated  # empty_cache ran: torch holds no cached, unused segments

    def reset_peak_memory_stats(self) -> None:
        self.transient = self.step_activations[self.steps] if self.steps < len(self.step_activations) else 0
        self.steps += 1

    def synchronize(self) -> None:
        pass

    def empty_cache(self) -> None:
        pass


@pytest.fixture
def fake_gpu(monkeypatch):
    """Make LLMEngine plan its KV on ``memory`` as a CUDA engine would (the model still runs on the CPU); loading
    the model allocates ``weights`` bytes on it and ``non_torch`` outside torch. Returns a setter."""
    loads: list[str] = []

    def install(memory: FakeMemory, weights: int, non_torch: int) -> list[str]:
        monkeypatch.setattr(KVMemoryPlanner, "start", classmethod(lambda cls, config: cls(config, memory)))
        real_load = engine_parts.load_model

        def load(*args, **kwargs):
            loads.append(args[0])
            result = real_load(*args, **kwargs)
            memory.load(weights)
            memory.grow_non_torch(non_torch)
            return result

        monkeypatch.setattr(engine_parts, "load_model", load)
        return loads

    return install


def test_plan_arithmetic_by_hand():
    plan = plan_kv_blocks(
        total_bytes=1000,
        free_at_start_bytes=950,
        utilization=0.9,
        weights_bytes=300,
        peak_activation_bytes=100,
        non_torch_bytes=50,
        scratch_bytes=30,
        bytes_per_block=40,
        min_blocks=4,
        extra_blocks=1,
    )
    # 900 - 300 - 100 - 50 - 30 = 420 bytes = 10 whole blocks of 40, one of which is the cache's padding sink
    assert (plan.requested_bytes, plan.kv_bytes, plan.num_blocks) == (900, 420, 9)
    assert "-> 9 blocks of 40 bytes" in plan.summary()
    assert plan.as_dict()["scratch_bytes"] == 30


def test_plan_errors_name_the_settings_and_the_numbers():
    common = dict(total_bytes=1000, weights_bytes=300, peak_activation_bytes=100, non_torch_bytes=50, scratch_bytes=30)
    with pytest.raises(MemoryPlanError, match=r"gpu_memory_utilization=0.9 asks for .* only .* were free"):
        plan_kv_blocks(**common, free_at_start_bytes=800, utilization=0.9, bytes_per_block=40, min_blocks=4)
    with pytest.raises(MemoryPlanError, match=r"no room for the KV cache.*-0\.00 GiB = 0 blocks.*kv_memory_mb"):
        plan_kv_blocks(**common, free_at_start_bytes=1000, utilization=0.4, bytes_per_block=40, min_blocks=1)
    # 420 bytes hold 10 blocks of 40; one max_model_len request needs 11
    with pytest.raises(MemoryPlanError, match=r"10 blocks of 40 bytes, fewer than the 11 one max_model_len request"):
        plan_kv_blocks(**common, free_at_start_bytes=1000, utilization=0.9, bytes_per_block=40, min_blocks=11)


def test_plan_counts_the_graph_pool_nccl_peers_and_the_reserve():
    figures = dict(
        total_bytes=1000,
        free_at_start_bytes=950,
        utilization=0.9,
        weights_bytes=300,
        peak_activation_bytes=100,
        non_torch_bytes=50,
        scratch_bytes=30,
        bytes_per_block=40,
        graph_pool_bytes=60,
        nccl_bytes=80,
        reserve_bytes=40,
    )
    plan = plan_kv_blocks(**figures, min_blocks=4)
    # 900 - 300 - 100 - 50 - 30 - 60 - 80 - 40 = 240 bytes = 6 blocks of 40
    assert (plan.kv_bytes, plan.num_blocks) == (240, 6)
    assert "graph pool 0.00, NCCL 0.00, reserve 0.00, KV 0.00 GiB -> 6 blocks" in plan.summary()
    with pytest.raises(MemoryPlanError, match=r"graph pool 0.00, NCCL 0.00 and reserve 0.00 GiB leaves .* 6 blocks"):
        plan_kv_blocks(**figures, min_blocks=7)


def test_the_profile_runs_a_full_prefill_step_of_max_model_len_prompts(tiny_llama_path, fake_gpu, monkeypatch):
    """The scheduler packs several prompts into one step up to max_batch_tokens, so the profile does too: 160 tokens
    with max_model_len 64 are two whole prompts and a 32-token chunk at the end of a 64-token context."""
    assert prefill_lengths(160, 64) == [64, 64, 32] and prefill_lengths(64, 256) == [64]
    profiled: list[list[tuple[int, int, int]]] = []
    real = KVMemoryPlanner._measure_step

    def measure(self, runner, sampler, chunks):
        profiled.append([(c.start, c.num_tokens, c.request.num_tokens) for c in chunks])
        return real(self, runner, sampler, chunks)

    monkeypatch.setattr(KVMemoryPlanner, "_measure_step", measure)
    memory = FakeMemory(total=64 * MIB, others=0, step_activations=[4 * MIB, 1 * MIB])
    fake_gpu(memory, weights=8 * MIB, non_torch=0)
    config = EngineConfig(
        model=str(tiny_llama_path),
        gpu_memory_utilization=0.5,
        max_model_len=64,
        max_num_seqs=4,
        max_batch_tokens=160,
        memory_reserve_bytes=0,
    )
    engine = LLMEngine(config)
    assert profiled[0] == [(0, 64, 64), (0, 64, 64), (32, 32, 64)]  # 160 tokens in one step
    assert profiled[1] == [(63, 1, 64)] * 4  # max_num_seqs decode rows at max_model_len context
    assert engine.memory_plan is not None and engine.memory_plan.peak_activation_bytes == 4 * MIB


def test_the_graph_pool_is_profiled_at_the_largest_keys(tiny_llama_path, fake_gpu, monkeypatch):
    """With decode graphs, the planner runs the graphs' static step at its largest key (batch 4 x 16 blocks here)
    and counts its peak plus one allocator segment per graph's kept output."""
    monkeypatch.setattr(engine_memory, "uses_decode_graphs", lambda config: True)  # the CUDA decision, on the CPU
    memory = FakeMemory(total=128 * MIB, others=0, step_activations=[2 * MIB, 3 * MIB, 5 * MIB])
    fake_gpu(memory, weights=8 * MIB, non_torch=0)
    config = EngineConfig(
        model=str(tiny_llama_path),
        gpu_memory_utilization=0.5,
        max_model_len=256,
        max_num_seqs=4,
        max_batch_tokens=64,
        memory_reserve_bytes=0,
    )
    engine = LLMEngine(config)
    plan = engine.memory_plan
    assert plan is not None and memory.steps == 3  # prefill, decode, the static step at key (4, 16)
    # batch buckets 1, 2, 4 x context buckets 1, 2, 4, 8, 16 blocks: 15 graphs, each output under one 2 MiB segment
    assert plan.graph_pool_bytes == 5 * MIB + 15 * SEGMENT_BYTES
    assert plan.peak_activation_bytes == 3 * MIB  # the static step is the pool's, not the activations'
    engine.check_no_leaks()


def test_nccl_peers_are_counted_per_pair_group(tiny_llama_path, fake_gpu, monkeypatch):
    monkeypatch.setattr(engine_memory, "NCCL_BYTES_PER_PEER", 2 * MIB)
    memory = FakeMemory(total=64 * MIB, others=0, step_activations=[1 * MIB, 1 * MIB])
    fake_gpu(memory, weights=8 * MIB, non_torch=0)
    base = dict(model=str(tiny_llama_path), gpu_memory_utilization=0.5, max_model_len=256, max_batch_tokens=64)
    plan = LLMEngine(EngineConfig(**base, max_num_seqs=4, nccl_peers=3, memory_reserve_bytes=0)).memory_plan
    assert plan is not None and plan.nccl_bytes == 6 * MIB


def test_a_prefill_only_engine_keeps_no_decode_graphs(tiny_llama_path, fake_gpu):
    """A prefill worker's engine never decodes: no graphs, so no static gather storage and no pool in its plan. It
    still runs one-token chunks (a prompt's last token after a cached prefix) on the decode path: its runner keeps
    that bound, and the decode step is profiled."""
    memory = FakeMemory(total=64 * MIB, others=0, step_activations=[2 * MIB, 1 * MIB])
    fake_gpu(memory, weights=8 * MIB, non_torch=0)
    config = EngineConfig(
        model=str(tiny_llama_path),
        gpu_memory_utilization=0.5,
        max_model_len=256,
        max_num_seqs=4,
        max_batch_tokens=64,
        memory_reserve_bytes=0,
        prefill_only=True,
    )
    engine = LLMEngine(config)
    plan = engine.memory_plan
    assert plan is not None and memory.steps == 2 and plan.graph_pool_bytes == 0
    assert plan.scratch_bytes == engine.runner.scratch_bytes_bound(4, 256) and engine.runner.decode_graphs is None
    assert not uses_decode_graphs(dataclasses.replace(engine.config, device="cuda"))
    assert uses_decode_graphs(dataclasses.replace(engine.config, device="cuda", prefill_only=False))
    engine.warm_up()  # a prefill, released: nothing left
    with pytest.raises(ValueError, match="only prefills"):
        engine.add_request([1, 2, 3], GREEDY)
    rid = engine.add_request([1, 2, 3], SamplingParams(max_tokens=1), prefill_only=True)
    [out] = engine.step()
    assert out.error is None and len(out.new_token_ids) == 1
    engine.release(rid)
    engine.check_no_leaks()


def test_explicit_budgets_win_over_measuring():
    memory = FakeMemory(total=64 * MIB, others=0, step_activations=[])
    assert needs_measured_budget(EngineConfig(device="cuda"))
    assert isinstance(KVMemoryPlanner.start(EngineConfig(device="cuda:1"), memory), KVMemoryPlanner)
    for config in (
        EngineConfig(device="cuda", kv_blocks=100),
        EngineConfig(device="cuda", kv_cache_memory_bytes=8 * MIB),
        EngineConfig(device="cpu"),
    ):
        assert not needs_measured_budget(config)
        assert KVMemoryPlanner.start(config, memory) is None


def test_measured_plan_sizes_the_engine(tiny_llama_path, fake_gpu, caplog):
    memory = FakeMemory(total=64 * MIB, others=10 * MIB, step_activations=[2 * MIB, 3 * MIB])
    fake_gpu(memory, weights=8 * MIB, non_torch=1 * MIB)
    config = EngineConfig(
        model=str(tiny_llama_path),
        gpu_memory_utilization=0.5,
        max_model_len=256,
        max_num_seqs=4,
        max_batch_tokens=64,
        memory_reserve_bytes=1 * MIB,
    )
    with caplog.at_level("INFO", logger="engine.memory"):
        engine = LLMEngine(config)
    plan = engine.memory_plan
    assert plan is not None and memory.steps == 2  # the prefill step and the decode step were profiled
    # the gather buffer's bound: 4 rows x 16 blocks (256 tokens) x 16 tokens x 2 KV heads x 16 dims x 4 bytes, K and V
    scratch = 2 * 4 * 16 * 16 * 2 * 16 * 4
    # the larger step's activations, the non-torch growth, the fixed reserve; no graphs (CPU), no NCCL peers
    kv = 32 * MIB - 8 * MIB - 3 * MIB - 1 * MIB - scratch - 1 * MIB
    assert (plan.graph_pool_bytes, plan.nccl_bytes, plan.reserve_bytes) == (0, 0, 1 * MIB)
    assert (plan.weights_bytes, plan.peak_activation_bytes, plan.non_torch_bytes) == (8 * MIB, 3 * MIB, 1 * MIB)
    assert (plan.scratch_bytes, plan.kv_bytes, plan.bytes_per_block) == (scratch, kv, BLOCK_BYTES)
    assert plan.num_blocks + plan.extra_blocks == kv // BLOCK_BYTES
    assert engine.block_manager.num_blocks == plan.num_blocks
    cache = engine.kv_cache
    assert cache.kv[0].shape[1] - cache.num_blocks == plan.extra_blocks
    assert sum(t.numel() * t.element_size() for t in cache.kv) <= plan.kv_bytes
    assert engine.runner.scratch_bytes_bound(4, 256) == scratch
    assert any(f"-> {plan.num_blocks} blocks of {BLOCK_BYTES} bytes" in r.message for r in caplog.records)
    results = engine.generate(["a prompt", "another, longer prompt"], [GREEDY, GREEDY])
    assert [len(r.token_ids) for r in results] == [8, 8]
    engine.check_no_leaks()


def test_no_room_for_one_request_is_a_clear_error(tiny_llama_path, fake_gpu):
    # 0.5 x 64 MiB = 32 MiB, less 31 MiB of weights and 1 MiB of activations: nothing left for 16 blocks
    memory = FakeMemory(total=64 * MIB, others=0, step_activations=[1 * MIB, 1 * MIB])
    fake_gpu(memory, weights=31 * MIB, non_torch=0)
    config = EngineConfig(
        model=str(tiny_llama_path),
        gpu_memory_utilization=0.5,
        max_model_len=256,
        max_num_seqs=4,
        memory_reserve_bytes=0,
    )
    with pytest.raises(MemoryPlanError, match=r"no room for the KV cache.*fewer than the 16 one max_model_len"):
        LLMEngine(config)


def test_a_share_larger_than_the_free_memory_fails_before_loading(tiny_llama_path, fake_gpu):
    memory = FakeMemory(total=64 * MIB, others=40 * MIB, step_activations=[])
    loads = fake_gpu(memory, weights=8 * MIB, non_torch=0)
    config = EngineConfig(model=str(tiny_llama_path), gpu_memory_utilization=0.5)
    with pytest.raises(MemoryPlanError, match=r"gpu_memory_utilization=0.5 asks for 0.03 GiB .* only 0.02 GiB"):
        LLMEngine(config)
    assert loads == []  # refused before minutes of loading weights


def test_gather_buffer_stays_within_its_bound(tiny_llama_path, make_engine):
    engine = make_engine(tiny_llama_path, max_num_seqs=4, max_model_len=64)
    bound = engine.runner.scratch_bytes_bound(4, 64)
    assert bound == 2 * 4 * 4 * 16 * 2 * 16 * 4  # 4 rows x 4 blocks of 16 tokens, K and V of one layer
    prompts = [[(7 * i + j) % 256 for j in range(50 + i)] for i in range(4)]  # 4 blocks each once decoding
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=f"r{i}")
    seen = []
    while engine.has_unfinished():
        outputs = engine.step()
        assert all(o.error is None for o in outputs)
        seen.append(engine.runner.scratch_bytes)
    assert max(seen) <= bound
    # the full batch was gathered (4 rows x 4 blocks): the buffer reached the bound, not its usual 5/4 headroom
    assert max(seen) == bound
    engine.check_no_leaks()


def test_a_batch_over_the_bound_fails_its_requests_clearly(tiny_llama_path, make_engine):
    engine = make_engine(tiny_llama_path, max_num_seqs=4, max_model_len=64)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i in range(2):
        engine.add_request([1 + i] * 20, params, request_id=f"r{i}")
    engine.step()  # both prompts (20 tokens = 2 blocks each) prefill
    engine.runner.limit_scratch(1, 32)  # room for 1 row x 2 blocks; the next step decodes 2 rows of 2 blocks
    outputs = engine.step()
    assert sorted(o.request_id for o in outputs) == ["r0", "r1"]
    for output in outputs:
        assert output.finish_reason is not None and output.finish_reason.value == "error"
        assert "gather buffer of 4 blocks, over the bound of 2 (max_num_seqs=1 x max_model_len=32)" in output.error
    engine.check_no_leaks()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_load_model_places_weights_in_the_requested_dtype(tiny_llama_path, dtype):
    model, _ = load_model(str(tiny_llama_path), dtype, "cpu")
    reference, _ = load_model(str(tiny_llama_path), "float32", "cpu")
    params = dict(model.named_parameters())
    assert params and all(p.device.type == "cpu" and p.dtype == getattr(torch, dtype) for p in params.values())
    for name, ref in reference.named_parameters():
        assert torch.equal(params[name], ref.to(params[name].dtype))
