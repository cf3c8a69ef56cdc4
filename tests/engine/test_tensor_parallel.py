"""Tensor parallelism on the CPU over gloo: N processes, one engine (rank 0) and N - 1 followers.

Exactness: the ranks' partial sums of o_proj and down_proj are added by an all-reduce, a different summation order
from one matmul, so outputs are compared token for token and the logprobs of every chosen token within 1e-4 (the
largest gap is printed).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
import torch

from engine.tensor_parallel import HeadSplit, StepKind, StepMessage, head_split
from engine.tp_launch import run_ranks as launch_ranks
from engine.tp_shard import check_degree

LOGPROB_TOLERANCE = 1e-4
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a quiet village,"]


def _generate(engine, prompts: list[str], max_tokens: int, prefix_repeat: bool, regex: str | None = None) -> dict:
    from engine.request import GuidedDecoding, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, ignore_eos=regex is None)
    if regex is not None:
        params.guided = GuidedDecoding("regex", regex)
    rounds = [prompts, [p + " and" for p in prompts]] if prefix_repeat else [prompts]
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    cached = 0
    for round_index, batch in enumerate(rounds):
        ids = [engine.add_request(p, params.copy(), request_id=f"r{round_index}-{i}") for i, p in enumerate(batch)]
        while engine.has_unfinished():
            for out in engine.step():
                assert out.error is None, out.error
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                logprobs.setdefault(out.request_id, []).extend(lp.logprob for lp in out.logprobs or [])
                if out.finished:
                    cached += out.num_cached_tokens
        assert set(ids) <= set(tokens)
    return {"tokens": tokens, "logprobs": logprobs, "cached_tokens": cached}


def _fail_when_a_follower_dies(engine, run: dict) -> dict:
    from engine.request import SamplingParams

    params = SamplingParams(max_tokens=run["max_tokens"], temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(run["prompts"]):
        engine.add_request(prompt, params.copy(), request_id=f"r{i}")
    started, errors = time.monotonic(), {}
    while engine.has_unfinished() and time.monotonic() - started < 120:
        for out in engine.step():
            if out.finished:
                errors[out.request_id] = out.error_code
    elapsed = time.monotonic() - started
    engine.check_no_leaks()
    return {"errors": errors, "elapsed_s": elapsed, "broken": engine.runner.step_channel.group.broken}


def _rank_main(rank: int, size: int, store_path: str, payload: tuple[str, dict]) -> dict:
    import torch.distributed as dist

    from engine.config import EngineConfig
    from engine.engine_parts import build_engine_parts
    from engine.expert_parallel import expert_traffic
    from engine.llm_engine import LLMEngine
    from engine.tensor_parallel import StepChannel, TPFollower, TPGroup

    model, run = payload
    torch.set_num_threads(1)
    timeout_s = run.get("timeout_s", 60.0)
    group = TPGroup(dist.FileStore(store_path, size), rank, size, timeout_s) if size > 1 else None
    config = EngineConfig(
        model=model,
        dtype="float32",
        kv_blocks=run.get("kv_blocks", 64),
        block_size=4,
        max_batch_tokens=run.get("max_batch_tokens", 2048),
        attention_backend=run.get("attention_backend", "auto"),
        tensor_parallel_size=run.get("tensor_parallel_size", size) if size > 1 else 1,
        expert_parallel_size=run.get("expert_parallel_size", 1) if size > 1 else 1,
        compile_decode_batches=run.get("compile_decode_batches"),
        kv_cache_dtype=run.get("kv_cache_dtype", "auto"),
        speculative=run.get("speculative"),
    )
    if rank > 0:
        parts = build_engine_parts(config, group)
        follower = TPFollower(parts.runner, StepChannel(group))
        if run.get("follower_dies_after_steps"):
            execute, limit = parts.runner.execute, run["follower_dies_after_steps"]

            def execute_then_die(chunks):
                if follower.steps + 1 >= limit:
                    os._exit(1)  # SIGKILL-like: no goodbye to the group
                return execute(chunks)

            parts.runner.execute = execute_then_die
        started = time.monotonic()
        ended = follower.serve()
        group.close()
        kv_heads = parts.kv_spec.num_kv_heads
        static = sum(parts.runner.decode_graphs.steps.values()) if parts.runner.decode_graphs is not None else 0
        served_s = time.monotonic() - started
        return {"ended": ended, "steps": follower.steps, "kv_heads": kv_heads, "served_s": served_s, "static": static}
    engine = LLMEngine(config, group)
    if run.get("leader_exits"):
        os._exit(0)  # gone without a word: no stop, no keep-alive
    idle_until = time.monotonic() + run.get("idle_s", 0.0)
    while time.monotonic() < idle_until:  # nothing to run: step() sends the keep-alives
        engine.step()
        time.sleep(0.05)
    if run.get("follower_dies_after_steps"):
        return _fail_when_a_follower_dies(engine, run)
    out = _generate(engine, run["prompts"], run["max_tokens"], run.get("prefix_repeat", False), run.get("regex"))
    out["texts"] = {rid: engine.tokenizer.decode(ids, skip_special_tokens=True) for rid, ids in out["tokens"].items()}
    out["proposed"] = engine.speculator.totals.proposed_tokens if engine.speculator is not None else 0
    engine.check_no_leaks()
    if engine.runner.step_channel is not None:
        engine.runner.step_channel.stop()
    if group is not None:
        group.close()
    preemptions = engine.scheduler.num_preemptions
    graphs = engine.runner.decode_graphs
    static = sum(graphs.steps.values()) if graphs is not None else 0
    traffic = expert_traffic(engine.model)
    return out | {
        "kv_heads": engine.kv_spec.num_kv_heads,
        "preemptions": preemptions,
        "static": static,
        "expert_traffic": traffic.summary() if traffic is not None else None,
        "parameters": sum(p.numel() for p in engine.model.parameters()),  # this rank's shard
    }


def run_ranks(size: int, model: Path, expect_missing: frozenset = frozenset(), **run) -> dict:
    """One rank in this process; more, each in a process of its own."""
    if size > 1:
        return launch_ranks(_rank_main, size, (str(model), run), timeout_s=240, expect_missing=expect_missing)
    threads = torch.get_num_threads()
    try:
        return {0: _rank_main(0, 1, "", (str(model), run))}
    finally:
        torch.set_num_threads(threads)


def _compare(one: dict, many: dict) -> float:
    assert many["tokens"] == one["tokens"]
    gap = max(
        abs(a - b) for rid in one["logprobs"] for a, b in zip(one["logprobs"][rid], many["logprobs"][rid], strict=True)
    )
    print(f"largest logprob gap against one rank: {gap:.2e}")
    assert gap < LOGPROB_TOLERANCE
    return gap


def test_head_split_covers_every_head_once_or_replicates_when_kv_heads_are_fewer():
    splits = [head_split(8, 4, 2, r) for r in range(2)]
    assert [(s.q_start, s.q_heads, s.kv_start, s.kv_heads) for s in splits] == [(0, 4, 0, 2), (4, 4, 2, 2)]
    replicated = [head_split(4, 2, 4, r) for r in range(4)]
    assert [(s.q_start, s.kv_start, s.kv_heads) for s in replicated] == [(0, 0, 1), (1, 0, 1), (2, 1, 1), (3, 1, 1)]
    assert all(s.replicated_kv for s in replicated) and not splits[0].replicated_kv
    assert head_split(9, 3, 3, 2) == HeadSplit(2, 3, 6, 3, 2, 1, 3, 3)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "size", "message"),
    [(9, 3, 2, "does not divide the model's 9 attention heads"), (8, 4, 8, None), (12, 8, 3, "KV heads")],
)
def test_a_degree_that_does_not_split_the_heads_names_the_field(heads, kv_heads, size, message):
    if message is None:
        head_split(heads, kv_heads, size, 0)
        return
    with pytest.raises(ValueError, match="tensor_parallel_size") as info:
        head_split(heads, kv_heads, size, 0)
    assert message in str(info.value)


def test_smollm2_cannot_split_two_ways(smollm2_path):
    from transformers import AutoConfig

    with pytest.raises(ValueError, match="tensor_parallel_size 2 does not divide the model's 9 attention heads"):
        check_degree(AutoConfig.from_pretrained(smollm2_path), 2)


def test_step_message_round_trips_a_step_with_prefills_and_decodes():
    from engine.request import Request, RequestTiming, SamplingParams
    from engine.scheduler import ScheduledChunk

    a = Request("a", [1, 2, 3, 4, 5], SamplingParams(), RequestTiming(0.0))
    a.block_ids = [7, 3]
    b = Request("b", [9, 8], SamplingParams(), RequestTiming(0.0))
    b.output_token_ids = [6]
    b.block_ids = [5]
    chunks = [ScheduledChunk(a, 0, 3), ScheduledChunk(b, 2, 1)]
    decoded = StepMessage.decode(StepKind.STEP, StepMessage(StepKind.STEP, chunks).encode())
    got = [
        (c.start, c.num_tokens, c.samples, c.request.block_ids, c.request.token_slice(c.start, c.end))
        for c in decoded.chunks
    ]
    assert got == [(0, 3, False, [7, 3], [1, 2, 3]), (2, 1, True, [5], [6])]


@pytest.mark.parametrize(
    "arch_fixture",
    # Llama in `make test`; the other families' cuts in `make test-e2e` (for the suite's 20 minutes)
    [
        "tiny_llama_path",
        *(
            pytest.param(name, marks=pytest.mark.e2e)
            for name in ("tiny_mistral_path", "tiny_qwen2_path", "tiny_qwen3_path")
        ),
    ],
)
def test_two_ranks_generate_what_one_does(arch_fixture, request):
    model = request.getfixturevalue(arch_fixture)
    run = {"prompts": PROMPTS, "max_tokens": 12, "prefix_repeat": True, "max_batch_tokens": 16}
    one = run_ranks(1, model, **run)[0]
    two = run_ranks(2, model, **run)
    _compare(one, two[0])
    assert two[0]["cached_tokens"] > 0  # the second round reused the first round's prompt blocks on both ranks
    assert two[1]["ended"] == "stop" and two[1]["steps"] > 0
    assert one["kv_heads"] == 2 and two[0]["kv_heads"] == two[1]["kv_heads"] == 1  # each rank caches its own head


@pytest.mark.parametrize(
    "arch",  # Gemma 2 (soft-caps, windows, a scaled embedding) and Phi-3 (fused projections) in `make test`
    ["gemma2", "phi3", *(pytest.param(arch, marks=pytest.mark.e2e) for arch in ("gemma3", "granite", "cohere"))],
)
def test_every_family_the_plan_cuts_gives_what_one_rank_does(arch, tmp_path):
    """Cut by the model's own plan, not a list of families: soft-caps, windows and per-head norms follow their heads,
    Gemma's scaled embedding is rebuilt on every rank, Granite's and Cohere's heads scale as on one rank, Phi-3's
    fused qkv_proj and gate_up_proj keep each rank's share of every part (its plan's gathered cuts, without the
    gather)."""
    from engine.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path, arch=arch)
    run = {"prompts": PROMPTS, "max_tokens": 12, "max_batch_tokens": 16}
    one = run_ranks(1, model, **run)[0]
    two = run_ranks(2, model, **run)
    _compare(one, two[0])
    assert one["kv_heads"] == 2 and two[0]["kv_heads"] == two[1]["kv_heads"] == 1
    assert two[1]["ended"] == "stop"


def test_latent_attention_splits_its_heads_and_every_rank_caches_the_whole_latent(tmp_path):
    """DeepSeek-V3 by its plan: q_b_proj and kv_b_proj by heads, o_proj by rows, the shared experts and the dense
    MLP in slices; kv_a_proj_with_mqa whole, so each rank caches the same latent row (one KV "head") and absorbs its
    own heads' part of kv_b_proj. A hand-off takes the latent from one sender rank, once to each receiver rank."""
    from engine.tensor_parallel import HandoffPart, handoff_parts
    from engine.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path, arch="deepseek_v3")
    run = {"prompts": PROMPTS, "max_tokens": 12, "max_batch_tokens": 16}  # chunked: context latents expanded too
    one = run_ranks(1, model, **run)[0]
    two = run_ranks(2, model, **run)
    _compare(one, two[0])
    assert one["kv_heads"] == two[0]["kv_heads"] == two[1]["kv_heads"] == 1
    assert handoff_parts(4, 1, 2, 2) == [HandoffPart(0, 0, 0, 0, 1), HandoffPart(0, 1, 0, 0, 1)]
    assert handoff_parts(4, 1, 2, 1) == [HandoffPart(0, 0, 0, 0, 1)]


@pytest.mark.parametrize(
    "arch, entry",
    [
        ("olmo2", "'layers.*.self_attn.q_proj': 'colwise_gather_output'"),  # q/k norms over every head: gathered
        ("gpt_oss", "'embed_tokens': 'embedding_rowwise'"),
    ],
)
def test_a_plan_entry_pdserve_cannot_run_is_refused_by_name(arch, entry):
    from transformers import AutoConfig

    from engine.tiny_model import TINY_ARCHITECTURES

    model_type = TINY_ARCHITECTURES[arch][0] if arch in TINY_ARCHITECTURES else arch
    config = AutoConfig.for_model(model_type, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match=f"tensor_parallel_size 2: model type '{arch}'.*{re.escape(entry)}"):
        check_degree(config, 2)
    check_degree(config, 1)  # one rank serves it


@pytest.mark.parametrize(
    "feature",
    [
        {"kv_cache_dtype": "int8"},  # each rank quantizes its own heads, a scale per token and head
        {"speculative": {"method": "ngram", "num_tokens": 3}, "prefix_repeat": True},  # verified rows on every rank
        {"regex": r"(yes|no), [0-9]{3}!", "max_tokens": 16},  # the grammar's mask on rank 0's logits
    ],
    ids=["int8-kv", "ngram-speculation", "regex-grammar"],
)
def test_two_ranks_with_a_feature_on_generate_what_one_does(tiny_llama_path, feature):
    """Quantized KV, speculative decoding and structured output at degree 2, each against degree 1 with it on."""
    import re

    run = {"prompts": PROMPTS, "max_tokens": 12, "max_batch_tokens": 16} | feature
    one = run_ranks(1, tiny_llama_path, **run)[0]
    two = run_ranks(2, tiny_llama_path, **run)
    _compare(one, two[0])
    if "regex" in feature:
        assert all(re.fullmatch(feature["regex"], text) for text in two[0]["texts"].values()), two[0]["texts"]
    if "speculative" in feature:
        assert two[0]["proposed"] > 0 and two[0]["proposed"] == one["proposed"]
    assert two[1]["ended"] == "stop"


@pytest.mark.e2e  # long (two ranks, flex compiled per rank): `make test-e2e`
def test_two_ranks_preempt_and_attend_with_flex_as_one_does(tiny_llama_path):
    """Few blocks force preemption (a request's blocks freed and its KV recomputed later), on FlexAttention: the ranks
    follow rank 0's block tables, so they recompute the same blocks."""
    run = {"prompts": PROMPTS, "max_tokens": 16, "kv_blocks": 12, "attention_backend": "flex"}
    one = run_ranks(1, tiny_llama_path, **run)[0]
    two = run_ranks(2, tiny_llama_path, **run)
    _compare(one, two[0])
    assert one["preemptions"] > 0 and two[0]["preemptions"] == one["preemptions"]


@pytest.mark.e2e
def test_four_ranks_over_two_kv_heads_replicate_them(tiny_llama_path):
    run = {"prompts": PROMPTS[:2], "max_tokens": 8}
    one = run_ranks(1, tiny_llama_path, **run)[0]
    four = run_ranks(4, tiny_llama_path, **run)
    _compare(one, four[0])
    assert [four[r]["kv_heads"] for r in range(4)] == [1, 1, 1, 1]


@pytest.mark.e2e
def test_smollm2_three_ranks_generate_what_one_does(smollm2_path):
    run = {"prompts": PROMPTS, "max_tokens": 8}
    one = run_ranks(1, smollm2_path, **run)[0]
    three = run_ranks(3, smollm2_path, **run)
    _compare(one, three[0])


def test_a_follower_that_dies_fails_its_step_and_breaks_the_group(tiny_llama_path):
    run = {"prompts": PROMPTS, "max_tokens": 8, "follower_dies_after_steps": 3, "timeout_s": 10.0}
    leader = run_ranks(2, tiny_llama_path, expect_missing=frozenset({1}), **run)[0]
    assert leader["errors"] == {f"r{i}": "worker_error" for i in range(len(PROMPTS))}
    assert leader["elapsed_s"] < 10.0 + 5.0  # within the group's timeout, not a hang
    assert "all-reduce" in leader["broken"] or "broadcast" in leader["broken"]


def test_a_follower_stops_within_the_timeout_when_rank_0_is_gone(tiny_llama_path):
    follower = run_ranks(2, tiny_llama_path, expect_missing=frozenset({0}), leader_exits=True, timeout_s=5.0)[1]
    assert follower["ended"] != "stop" and "broadcast" in follower["ended"]
    assert follower["served_s"] < 5.0 + 5.0


@pytest.mark.e2e  # `make test-e2e` (for the suite's 20 minutes): the followers' timeouts are the tests above's
def test_an_idle_rank_0_keeps_its_followers_waiting(tiny_llama_path):
    run = {"prompts": PROMPTS[:1], "max_tokens": 4, "idle_s": 6.0, "timeout_s": 3.0}
    ranks = run_ranks(2, tiny_llama_path, **run)
    assert ranks[1]["ended"] == "stop" and ranks[0]["tokens"]


@pytest.mark.e2e  # `make test-e2e` (for the suite's 20 minutes): two ranks compiling; eager degree 2 stays
def test_the_compiled_decode_step_at_degree_two_is_token_exact_against_one_rank(tiny_llama_path):
    """The compiled CPU decode step with the ranks' all-reduces inside it (functional collectives on the device
    group): every rank runs the same compiled steps, and the tokens are one rank's (eager at degree 2 is too, above)."""
    run = {"prompts": PROMPTS, "max_tokens": 8}
    one = run_ranks(1, tiny_llama_path, **run)[0]
    ranks = run_ranks(2, tiny_llama_path, **run, compile_decode_batches=[1, 2, 4])
    compiled = ranks[0]
    assert compiled["static"] > 0 and ranks[1]["static"] == compiled["static"]  # every rank took the same steps
    _compare(one, compiled)  # the same tokens, logprobs within the tolerance


def test_each_group_gets_its_backend_by_the_device_it_is_given():
    """A worker's two groups: the layers' collectives on NCCL for CUDA tensors and on gloo for host ones, the step
    messages on gloo either way. Checked by the device type given, so without a GPU too."""
    from engine.tensor_parallel import group_backends

    assert group_backends(torch.device("cuda", 1)) == ("nccl", "gloo")
    assert group_backends("cuda") == ("nccl", "gloo")
    assert group_backends("cpu") == ("gloo", "gloo")


def test_a_cpu_rank_has_two_gloo_groups_and_its_device_group_is_named(tmp_path):
    """Degree 1 is enough to build both: the device group is registered under its name (what a compiled step's
    functional all-reduce resolves), apart from the CPU group, and dropped at close."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import _resolve_process_group

    from engine.tensor_parallel import TPGroup

    group = TPGroup(dist.FileStore(str(tmp_path / "store"), 1), 0, 1, 10.0)
    try:
        assert group.device_backend == "gloo"
        assert _resolve_process_group(group.device_group_name) is group._device
        assert group._device is not group._cpu
        summed = group.all_reduce(torch.ones(3))
        assert summed.tolist() == [1.0, 1.0, 1.0] and group.broadcast(torch.arange(4)).tolist() == [0, 1, 2, 3]
    finally:
        group.close()
    with pytest.raises(Exception):  # noqa: B017 - the name no longer resolves once the group is closed
        _resolve_process_group(group.device_group_name)
