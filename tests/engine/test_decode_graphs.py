"""Decode steps over static, padded buffers (``engine.decode_graphs``), run eagerly on the CPU (``StaticStep.EAGER``).

This is the arithmetic a CUDA graph records: the batch padded up to a bucket, the gather padded up to a context
bucket, padding rows writing into the KV cache's sink block. The tests compare it token for token with the eager
engine over runs whose batch sizes and context lengths cross bucket boundaries, check that padding rows never touch
a request's KV, and check each rule that sends a step back to the eager path. The capture itself needs a GPU.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.decode_graphs import (
    DecodeGraphs,
    Fallback,
    StaticStep,
    _Entry,
    _Key,
    batch_buckets,
    bucket_for,
    context_buckets,
    decode_graphs_for,
    plan_keys,
    scratch_bytes_for,
)
from engine.request import RequestOutput, SamplingParams
from engine.tiny_model import build_tiny_model
from tests.helpers.engine import random_prompts

SETTINGS = dict(block_size=4, max_num_seqs=6, max_model_len=256, max_batch_tokens=64)


def _static(engine, **overrides) -> DecodeGraphs:
    """Put the engine's decode-only steps on the static padded path (eager: no capture on the CPU)."""
    settings = dict(max_num_seqs=engine.config.max_num_seqs, max_model_len=engine.max_model_len, mode=StaticStep.EAGER)
    settings.update(overrides)
    graphs = DecodeGraphs(engine.runner, **settings)
    engine.runner.decode_graphs = graphs
    return graphs


def _run(engine, prompts, params: list[SamplingParams], arrivals: list[int] | None = None):
    """Every output of every request, by request id (the prompt's index); prompt i is added before step
    ``arrivals[i]`` (default: all before the first)."""
    arrivals = arrivals or [0] * len(prompts)
    outputs: dict[str, list[RequestOutput]] = {}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished():
        for index, (prompt, p) in enumerate(zip(prompts, params)):
            if arrivals[index] == step:
                engine.add_request(prompt, p.copy(), request_id=str(index))
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
        step += 1
    return outputs


def _tokens(outputs: dict[str, list[RequestOutput]]) -> dict[str, list[int]]:
    return {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in outputs.items()}


def _greedy(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **extra)


def test_buckets():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(1) == [1]
    assert context_buckets(2048, 16) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert context_buckets(100, 16) == [1, 2, 4, 7]  # 100 tokens need 7 blocks
    buckets = batch_buckets(6)
    assert [bucket_for(n, buckets) for n in range(1, 8)] == [1, 2, 4, 4, 6, 6, None]
    # keys: every one fits the gather budget, and the next context bucket of a batch bucket would not
    block_bytes, budget = 64 * 1024, 512 * 1024 * 1024
    keys = plan_keys(128, 8192, 16, block_bytes, budget)
    ctx = context_buckets(8192, 16)
    assert keys and all(b * c * block_bytes <= budget for b, c in keys)
    for batch in batch_buckets(128):
        widest = max(c for b, c in keys if b == batch)
        assert widest == ctx[-1] or batch * ctx[ctx.index(widest) + 1] * block_bytes > budget


def test_static_decode_is_token_exact_across_buckets(make_engine, tiny_llama_path):
    """Nine prompts arriving over time through six slots: batches of 1 to 6 (buckets 1, 2, 4, 6: padded at 3 and
    5), contexts from 3 to 90 tokens (gather widths 1 to 32 blocks), and mixed prefill+decode steps whenever a prompt
    joins running decodes (those run eagerly)."""
    lengths = (3, 5, 2, 40, 9, 30, 4, 12, 7)
    prompts = [prompt[:n] for prompt, n in zip(random_prompts(9, 40, 40, seed=3), lengths)]
    params = [_greedy(n) for n in (60, 30, 20, 40, 25, 8, 30, 12, 5)]
    arrivals = [0, 12, 20, 20, 30, 31, 32, 33, 34]
    expected = _tokens(_run(make_engine(tiny_llama_path, **SETTINGS), prompts, params, arrivals))
    engine = make_engine(tiny_llama_path, **SETTINGS)
    graphs = _static(engine)
    assert _tokens(_run(engine, prompts, params, arrivals)) == expected
    batches = {b for b, _ in graphs.steps}
    widths = {c for _, c in graphs.steps}
    assert batches == {1, 2, 4, 6} and {1, 2, 4, 8, 16, 32} <= widths, graphs.steps
    assert graphs.fallbacks[Fallback.NOT_DECODE] > 0  # the prefills, and steps where a prompt joins running decodes
    assert set(graphs.fallbacks) == {Fallback.NOT_DECODE}


def test_static_decode_matches_eager_with_sampling_and_logprobs(make_engine, tiny_llama_path):
    """Seeded sampling and per-token logprobs see the same logits (padding rows are dropped before the lm_head)."""
    prompts = random_prompts(3, 5, 20, seed=4)
    params = [SamplingParams(max_tokens=10, temperature=0.8, top_k=20, seed=i, logprobs=2) for i in range(3)]
    eager = _run(make_engine(tiny_llama_path, **SETTINGS), prompts, params)
    engine = make_engine(tiny_llama_path, **SETTINGS)
    graphs = _static(engine)
    static = _run(engine, prompts, params)
    assert _tokens(static) == _tokens(eager)
    for rid in eager:
        got = [lp.logprob for o in static[rid] for lp in o.logprobs or []]
        want = [lp.logprob for o in eager[rid] for lp in o.logprobs or []]
        assert got == pytest.approx(want, abs=1e-4)
    assert sum(graphs.steps.values()) > 0


def _real_kv(engine) -> list[torch.Tensor]:
    """Every layer's K/V of the block manager's blocks (the sink excluded), as [2, slots, kvH, d] copies."""
    num_slots = engine.kv_cache.num_blocks * engine.config.block_size
    return [engine.kv_cache.flat(layer)[:, :num_slots].clone() for layer in range(engine.kv_spec.num_layers)]


def _changed_slots(before: list[torch.Tensor], after: list[torch.Tensor]) -> set[int]:
    changed: set[int] = set()
    for old, new in zip(before, after):
        differs = (old != new).flatten(2).any(dim=2).any(dim=0)  # [slots]
        changed.update(differs.nonzero().flatten().tolist())
    return changed


def test_padding_rows_never_touch_a_request_kv(make_engine, tiny_llama_path):
    """Three running decodes pad to a batch of four: after the step, the only real slots whose bytes changed are the
    three new tokens' slots; the padding row wrote the sink block. The capture's warm-up runs (every row padding)
    change no real slot at all."""
    engine = make_engine(tiny_llama_path, **SETTINGS)
    graphs = _static(engine)
    for index, prompt in enumerate(random_prompts(3, 6, 13, seed=5)):
        engine.add_request(prompt, _greedy(8), request_id=str(index))
    while any(not r.output_token_ids for r in engine.requests.values()):
        engine.step()
    requests = list(engine.requests.values())
    assert any(0 in r.block_ids for r in requests)  # block 0 holds a request's KV (a naive padding slot 0 hits it)
    sink = engine.kv_cache.kv[0][:, engine.kv_cache.padding_sink_block].clone()

    before = _real_kv(engine)
    steps = sum(graphs.steps.values())
    engine.step()
    assert sum(graphs.steps.values()) == steps + 1 and any(b == 4 for b, _ in graphs.steps)
    bs = engine.config.block_size
    written = [r.num_computed_tokens - 1 for r in requests]  # the position each request computed in that step
    new_slots = {r.block_ids[p // bs] * bs + p % bs for r, p in zip(requests, written)}
    assert _changed_slots(before, _real_kv(engine)) == new_slots
    assert not torch.equal(engine.kv_cache.kv[0][:, engine.kv_cache.padding_sink_block], sink)

    before = _real_kv(engine)
    with torch.inference_mode():
        for key in (_Key(4, 4), _Key(6, 64)):
            graphs._fill(None, key)  # what _capture runs before its warm-up and capture
            graphs._forward_static(key)
    assert _changed_slots(before, _real_kv(engine)) == set()
    while engine.has_unfinished():
        engine.step()


def test_fallback_rules(make_engine, tiny_llama_path):
    """Each rule sends its step to the eager path, and the user sees the same outputs as on an eager engine."""
    # a batch over the largest bucket, and a batch x context over the gather budget
    prompts = random_prompts(5, 3, 10, seed=6)
    params = [_greedy(n) for n in (6, 14, 9, 20, 12)]
    expected = _tokens(_run(make_engine(tiny_llama_path, **SETTINGS), prompts, params))
    engine = make_engine(tiny_llama_path, **SETTINGS)
    probe = _static(engine)
    graphs = _static(engine, max_num_seqs=2, max_gather_bytes=8 * probe.gather_block_bytes)
    assert graphs.batch_buckets == [1, 2] and graphs.max_gather_blocks == 8
    assert graphs.scratch_bytes == scratch_bytes_for(engine.kv_spec, 2, 256, 8 * probe.gather_block_bytes)
    assert _tokens(_run(engine, prompts, params)) == expected
    assert graphs.fallbacks[Fallback.BATCH_TOO_LARGE] > 0 and graphs.fallbacks[Fallback.GATHER_TOO_WIDE] > 0
    assert graphs.steps and all(b * c <= 8 for b, c in graphs.steps)

    # prompt logprobs: a 17-token prompt in chunks of 16 + 1 makes a decode-shaped step that must score the prompt
    settings = {**SETTINGS, "max_batch_tokens": 16}
    params = [_greedy(4, prompt_logprobs=2)]
    prompt = random_prompts(1, 17, 17, seed=7)
    eager = _run(make_engine(tiny_llama_path, **settings), prompt, params)
    engine = make_engine(tiny_llama_path, **settings)
    graphs = _static(engine)
    static = _run(engine, prompt, params)
    assert _tokens(static) == _tokens(eager)
    got = [o.prompt_logprobs for o in static["0"] if o.prompt_logprobs]
    want = [o.prompt_logprobs for o in eager["0"] if o.prompt_logprobs]
    assert len(got) == 1 and len(got[0]) == 17
    assert [e.logprob if e else None for e in got[0]] == [e.logprob if e else None for e in want[0]]
    assert graphs.fallbacks[Fallback.PROMPT_LOGPROBS] == 1 and sum(graphs.steps.values()) == 3

    # a layer hook (streaming KV export, fault injection) runs Python per layer: no graph can, so no static step
    engine = make_engine(tiny_llama_path, **SETTINGS)
    graphs = _static(engine)
    layers_seen: list[int] = []
    engine.set_layer_hook(lambda layer, batch: layers_seen.append(layer))
    engine.generate(random_prompts(2, 4, 9, seed=8), _greedy(5))
    assert not graphs.steps and graphs.fallbacks[Fallback.LAYER_HOOK] == 4
    assert len(layers_seen) == engine.kv_spec.num_layers * 5  # one prefill step and four decode steps, every layer


class _ReplayByCall:
    """Stands in for a captured ``torch.cuda.CUDAGraph`` on the CPU with the same contract: ``replay()`` reruns the
    step function over the static buffers and writes the same static output tensor (what a graph's replay does)."""

    def __init__(self, graphs: DecodeGraphs, key: _Key) -> None:
        self.graphs, self.key = graphs, key
        self.hidden = graphs._forward_static(key).clone()

    def replay(self) -> None:
        self.hidden.copy_(self.graphs._forward_static(self.key))


def test_graph_limit_and_replay_path(make_engine, tiny_llama_path, monkeypatch):
    """The replay branch of ``execute`` (static output, padding rows dropped) with capture faked on the CPU, and the
    bound on graphs: once ``max_graphs`` exist, a step of a new bucket runs eagerly."""
    captured: list[tuple[int, int]] = []

    def fake_capture(self: DecodeGraphs, key: _Key) -> _Entry:
        self._fill(None, key)  # as the real capture: every row padding
        graph = _ReplayByCall(self, key)
        captured.append((key.batch, key.blocks))
        return _Entry(graph, graph.hidden)  # type: ignore[arg-type]

    monkeypatch.setattr(DecodeGraphs, "_capture", fake_capture)
    prompts = random_prompts(4, 3, 12, seed=9)
    params = [_greedy(n) for n in (5, 18, 9, 24)]
    expected = _tokens(_run(make_engine(tiny_llama_path, **SETTINGS), prompts, params))
    engine = make_engine(tiny_llama_path, **SETTINGS)
    graphs = _static(engine, max_graphs=2)
    graphs.mode = StaticStep.GRAPHS  # construction refuses capture on the CPU; the capture itself is faked above
    assert _tokens(_run(engine, prompts, params)) == expected
    assert len(captured) == graphs.num_graphs == 2 and graphs.num_replays == sum(graphs.steps.values()) > 2
    assert set(graphs.steps) == set(captured) and graphs.fallbacks[Fallback.GRAPH_LIMIT] > 0


def test_graphs_are_cuda_only(make_engine, tiny_llama_path):
    engine = make_engine(tiny_llama_path, **SETTINGS, cuda_graphs=True)
    assert engine.runner.decode_graphs is None  # the CPU never captures
    assert decode_graphs_for(engine.runner, engine.config, engine.max_model_len) is None
    with pytest.raises(ValueError, match="CUDA device"):
        DecodeGraphs(engine.runner, 6, 256, StaticStep.GRAPHS)


def test_warm_captures_every_graph_a_growing_batch_meets_and_then_none(make_engine, tiny_llama_path, monkeypatch):
    """``warm(rows, max_context)`` captures, before a measurement, the graphs of the batch's bucket at every context
    bucket up to ``max_context``: the measured steps then replay and never capture (a capture syncs the device)."""
    captured: list[tuple[int, int]] = []

    def fake_capture(self: DecodeGraphs, key: _Key) -> _Entry:
        self._fill(None, key)
        graph = _ReplayByCall(self, key)
        captured.append((key.batch, key.blocks))
        return _Entry(graph, graph.hidden)  # type: ignore[arg-type]

    monkeypatch.setattr(DecodeGraphs, "_capture", fake_capture)
    engine = make_engine(tiny_llama_path, **SETTINGS)  # block 4, max_num_seqs 6, max_model_len 256
    graphs = _static(engine)
    graphs.mode = StaticStep.GRAPHS
    prompts = random_prompts(3, 10, 10, seed=10)
    params = [_greedy(30)] * 3  # contexts grow from 11 to 40 tokens: 3 to 10 blocks
    assert graphs.warm(3, 40) == 5  # batch bucket 4 x every context bucket up to 16 blocks (40 tokens: 10 blocks)
    assert captured == [(4, 1), (4, 2), (4, 4), (4, 8), (4, 16)]
    before = list(captured)
    _run(engine, prompts, params)
    assert captured == before and graphs.num_replays > 0  # the run met no graph it had to capture
    assert graphs.warm(3, 40) == 0


# ---- the compiled CPU step (StaticStep.COMPILED, ``compile_decode_batches``) ----------------------------------------


def test_compiled_decode_is_token_exact_with_eager(make_engine, tiny_llama_path):
    """The run of ``test_static_decode_is_token_exact_across_buckets`` with the step compiled for batches 2 and 4 at
    start-up: every context width runs on those two graphs (no compile while serving), batches of 5 and 6 run
    eagerly, and every token is the eager engine's."""
    lengths = (3, 5, 2, 40, 9, 30, 4, 12, 7)
    prompts = [prompt[:n] for prompt, n in zip(random_prompts(9, 40, 40, seed=3), lengths)]
    params = [_greedy(n) for n in (60, 30, 20, 40, 25, 8, 30, 12, 5)]
    arrivals = [0, 12, 20, 20, 30, 31, 32, 33, 34]
    expected = _tokens(_run(make_engine(tiny_llama_path, **SETTINGS), prompts, params, arrivals))
    engine = make_engine(tiny_llama_path, **SETTINGS, compile_decode_batches=[4, 2])
    graphs = engine.runner.decode_graphs
    assert graphs is not None and graphs.mode is StaticStep.COMPILED
    assert set(graphs.compile_s) == {2, 4} and all(s > 0 for s in graphs.compile_s.values())
    assert graphs.context_buckets[0] == 2  # a width of one block would be a graph of its own
    assert _tokens(_run(engine, prompts, params, arrivals)) == expected
    assert {b for b, _ in graphs.steps} == {2, 4}
    assert {2, 4, 8, 16, 32} <= {c for _, c in graphs.steps}, graphs.steps
    assert graphs.fallbacks[Fallback.BATCH_TOO_LARGE] > 0 and Fallback.CAPTURE_FAILED not in graphs.fallbacks


def test_a_compiled_step_that_would_compile_again_runs_eagerly(make_engine, tiny_llama_path):
    """A step the start-up compile did not cover (here a batch of 3 forced onto the step) is not compiled while
    serving: it runs eagerly with the same result, and so does every later step of that engine."""
    engine = make_engine(tiny_llama_path, **SETTINGS, compile_decode_batches=[2])
    graphs = engine.runner.decode_graphs
    key = _Key(3, 2)
    graphs._fill(None, key)
    with torch.inference_mode():
        expected = graphs._forward_static(key).clone()
        got = graphs._run_compiled(key)
    assert torch.equal(got, expected)
    assert not graphs._compiled and graphs.fallback_reason([]) is Fallback.CAPTURE_FAILED


def test_a_failed_compile_leaves_the_engine_eager(make_engine, tiny_llama_path, monkeypatch, tmp_path):
    def broken_compile(fn, **kwargs):
        def run(*args):
            raise RuntimeError("the compiler is broken")

        return run

    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))  # nothing kept on disk: the engine must compile
    monkeypatch.setattr(torch, "compile", broken_compile)
    prompts = random_prompts(2, 3, 8, seed=5)
    params = [_greedy(6)] * 2
    expected = _tokens(_run(make_engine(tiny_llama_path, **SETTINGS), prompts, params))
    engine = make_engine(tiny_llama_path, **SETTINGS, compile_decode_batches=[2])
    graphs = engine.runner.decode_graphs
    assert graphs.compile_s == {} and not graphs._compiled
    assert _tokens(_run(engine, prompts, params)) == expected
    assert graphs.fallbacks[Fallback.CAPTURE_FAILED] > 0 and not graphs.steps


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(compile_decode_batches=[]), "non-empty list"),
        (dict(compile_decode_batches=[0]), r"in \[1, max_num_seqs=6\]"),
        (dict(compile_decode_batches=[7]), r"in \[1, max_num_seqs=6\]"),
        (dict(compile_decode_batches=[True]), r"in \[1, max_num_seqs=6\]"),
        (dict(compile_decode_batches=[2, 2]), "at most 8 distinct"),
        (dict(compile_decode_batches=[1], device="cuda"), "is for the CPU"),
    ],
)
def test_compile_decode_batches_config_errors_name_the_field(overrides, message):
    with pytest.raises(ValueError, match="compile_decode_batches") as info:
        EngineConfig(max_num_seqs=6, **overrides)
    assert info.match(message)


def test_a_compiled_step_is_configured_at_any_tensor_parallel_degree():
    """The ranks' all-reduces go inside the compiled step (tests/engine/test_tensor_parallel.py runs it at degree 2)."""
    assert EngineConfig(max_num_seqs=6, compile_decode_batches=[1, 2], tensor_parallel_size=2).compile_decode_batches


def test_a_prefill_only_engine_compiles_nothing(make_engine, tiny_llama_path):
    engine = make_engine(tiny_llama_path, **SETTINGS, compile_decode_batches=[2], prefill_only=True)
    assert engine.runner.decode_graphs is None


def test_a_compiled_step_keeps_its_graphs_when_the_cache_moves(make_engine, tiny_llama_path):
    """A decode worker moves its cache into a shared segment (``KVCache.rehome``: every layer a view of one mapping)
    after the engine, so after the compile: the compiled step runs on the moved cache, compiling nothing again."""
    prompts = random_prompts(3, 4, 12, seed=6)
    params = [_greedy(n) for n in (20, 12, 30)]
    expected = _tokens(_run(make_engine(tiny_llama_path, **SETTINGS), prompts, params))
    engine = make_engine(tiny_llama_path, **SETTINGS, compile_decode_batches=[4])
    cache = engine.kv_cache
    layer_elems = cache.kv[0].numel()
    whole = torch.zeros(len(cache.kv) * layer_elems, dtype=cache.kv[0].dtype)
    cache.rehome([whole[i * layer_elems : (i + 1) * layer_elems].view(cache.kv[0].shape) for i in range(len(cache.kv))])
    graphs = engine.runner.decode_graphs
    assert _tokens(_run(engine, prompts, params)) == expected
    assert sum(graphs.steps.values()) > 10 and Fallback.CAPTURE_FAILED not in graphs.fallbacks
    assert any(t.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr() for t in cache.kv)


@pytest.mark.parametrize("compiled", [False, True])
def test_static_verification_of_proposals_is_token_exact(make_engine, tiny_llama_path, compiled):
    """A verified proposal's tokens are rows of the static step (each attending up to itself): verification steps
    run there, compiled or not, and greedy output is the plain eager engine's."""
    prompts = [p * 3 for p in random_prompts(3, 4, 6, seed=8)]  # repeats: n-grams to propose from
    params = [_greedy(n) for n in (24, 16, 30)]
    expected = _tokens(_run(make_engine(tiny_llama_path, **SETTINGS), prompts, params))
    spec = dict(method="ngram", num_tokens=3)
    if compiled:
        engine = make_engine(tiny_llama_path, **SETTINGS, compile_decode_batches=[2, 4, 6], speculative=spec)
        graphs = engine.runner.decode_graphs
    else:
        engine = make_engine(tiny_llama_path, **SETTINGS, speculative=spec)
        graphs = _static(engine)
    assert _tokens(_run(engine, prompts, params)) == expected
    stats = list(engine.step_stats)
    assert engine.speculator.totals.verify_steps > 0 and engine.speculator.totals.accepted_tokens > 0
    assert any(s.num_prefill_tokens == 0 and s.num_decode_tokens > s.num_seqs for s in stats)  # verifications
    # only the steps with a prompt's tokens ran eagerly as "not decode": every verification ran on the static step
    assert graphs.fallbacks[Fallback.NOT_DECODE] == sum(1 for s in stats if s.num_prefill_tokens)
    assert Fallback.CAPTURE_FAILED not in graphs.fallbacks


def test_two_compiled_engines_in_one_process_each_run_their_own_weights(make_engine, tiny_llama_path, tmp_path):
    """In-process workers share torch.compile's graphs (one code object, same guards): each call reads its own
    engine's weights and cache, so two engines of different weights stay token-exact with their eager selves."""
    other_path = build_tiny_model(tmp_path / "other", arch="llama", seed=1)
    prompts = random_prompts(2, 4, 10, seed=12)
    params = [_greedy(16)] * 2
    outputs = []
    for path in (tiny_llama_path, other_path):
        expected = _tokens(_run(make_engine(path, **SETTINGS), prompts, params))
        engine = make_engine(path, **SETTINGS, compile_decode_batches=[2])
        assert _tokens(_run(engine, prompts, params)) == expected
        assert sum(engine.runner.decode_graphs.steps.values()) > 10
        outputs.append(expected)
    assert outputs[0] != outputs[1]  # the two models answer differently: the check above tells them apart
