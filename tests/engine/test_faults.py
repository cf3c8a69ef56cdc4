"""A fault stays with the request that caused it: odd sampling parameters, non-finite logits and failed forwards
end that request (finish_reason "error", blocks freed), never the batch, and the engine keeps serving."""

from __future__ import annotations

import pytest
import torch

from engine.request import FinishReason, Request, RequestTiming, SamplingParams
from engine.sampler import sample

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=0.8, top_k=40, top_p=0.95, seed=7, ignore_eos=True)
PROMPTS = ["first prompt", "the second one", "and a third"]


def _tokens(outputs) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def test_tiny_temperature_is_greedy_and_harms_no_one(tiny_llama_path, make_engine):
    engine = make_engine(tiny_llama_path)
    expected = engine.generate(PROMPTS, [GREEDY, GREEDY, SEEDED])
    odd = SamplingParams(max_tokens=8, temperature=1e-40, ignore_eos=True)
    results = engine.generate(PROMPTS, [odd, GREEDY, SEEDED])
    assert odd.greedy and SamplingParams(temperature=1e-5).greedy is False
    assert [r.token_ids for r in results] == [e.token_ids for e in expected]
    assert [r.finish_reason for r in results] == ["length"] * 3
    engine.check_no_leaks()


def _poison_row(engine, victim: str, value: float, after_tokens: int) -> list[int]:
    """Make the victim's logits row ``value`` from its ``after_tokens``-th generated token on; returns a hit count."""
    original = engine.runner.execute
    hits = [0]

    def execute(chunks):
        logits, stats = original(chunks)
        logits = logits.clone()  # an inference tensor: edited outside inference mode, it needs a copy
        rows = [c for c in chunks if c.samples]
        for row, chunk in enumerate(rows):
            req = chunk.request
            if req.request_id == victim and len(req.output_token_ids) >= after_tokens:
                logits[row] = value
                hits[0] += 1
        return logits, stats

    engine.runner.execute = execute
    return hits


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("victim_params", [GREEDY, SEEDED], ids=["greedy", "sampled"])
def test_non_finite_logits_fail_only_that_request(tiny_llama_path, make_engine, value, victim_params):
    engine = make_engine(tiny_llama_path)
    params = [GREEDY, victim_params, SEEDED]
    expected = engine.generate(PROMPTS, params)
    hits = _poison_row(engine, "victim", value, after_tokens=3)
    ids = [engine.add_request(p, sp, rid) for p, sp, rid in zip(PROMPTS, params, ["a", "victim", "c"])]
    outputs: dict[str, list] = {rid: [] for rid in ids}
    for _ in range(100):  # bounded: 8 tokens each
        if not engine.has_unfinished():
            break
        for output in engine.step():
            outputs[output.request_id].append(output)
    assert hits[0] == 1  # failed at once, never scheduled again
    last = outputs["victim"][-1]
    assert last.finished and last.finish_reason == FinishReason.ERROR and last.new_token_ids == []
    assert "not finite" in last.error and last.error_code == "sampling_error"
    # what it produced before the fault is kept; nothing made up (a NaN row must not become token 0)
    assert _tokens(outputs["victim"]) == expected[1].token_ids[:3]
    assert _tokens(outputs["a"]) == expected[0].token_ids and outputs["a"][-1].finish_reason == FinishReason.LENGTH
    assert _tokens(outputs["c"]) == expected[2].token_ids and outputs["c"][-1].finish_reason == FinishReason.LENGTH
    engine.check_no_leaks()


def test_generate_reports_a_failed_request(tiny_llama_path, make_engine):
    engine = make_engine(tiny_llama_path)
    [expected] = engine.generate([PROMPTS[0]], GREEDY)
    original = engine.runner.execute

    def execute(chunks):
        logits, stats = original(chunks)
        return torch.full_like(logits, float("nan")), stats

    engine.runner.execute = execute
    results = engine.generate(PROMPTS[:2], GREEDY)
    assert [r.finish_reason for r in results] == ["error", "error"] and all("not finite" in r.error for r in results)
    engine.runner.execute = original
    [again] = engine.generate([PROMPTS[0]], GREEDY)
    assert again.token_ids == expected.token_ids and again.error is None
    engine.check_no_leaks()


def test_sampler_fails_rows_not_the_batch():
    vocab = 32
    logits = torch.randn(4, vocab)
    logits[1] = float("nan")
    logits[3] = float("-inf")  # nothing left to sample
    temperatures = [0.0, 0.0, 1.0, 1.0]
    reqs = [
        Request(str(i), [1], SamplingParams(temperature=t, seed=1), RequestTiming(0.0))
        for i, t in enumerate(temperatures)
    ]
    result = sample(logits, reqs)
    assert result.token_ids[0] == int(logits[0].argmax()) and result.errors[0] is None
    assert result.token_ids[2] is not None and result.errors[2] is None
    assert result.token_ids[1] is None and "not finite" in result.errors[1]
    assert result.token_ids[3] is None and result.errors[3]
    # a huge but finite logit divided by a small temperature overflows: that row fails, it does not raise
    big = torch.zeros(1, vocab)
    big[0, 3] = 3e38
    overflow = sample(big, [Request("x", [1], SamplingParams(temperature=1e-3, seed=1), RequestTiming(0.0))])
    assert overflow.token_ids == [None] and "not finite" in overflow.errors[0]


@pytest.mark.parametrize("where", ["execute", "layer_hook"])
def test_failed_forward_fails_that_step_and_the_engine_goes_on(tiny_llama_path, make_engine, where):
    engine = make_engine(tiny_llama_path)
    expected = engine.generate(PROMPTS, [GREEDY, GREEDY, SEEDED])
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS[:2], [GREEDY, GREEDY])]
    for _ in range(3):
        engine.step()  # both are decoding now
    late = engine.add_request(PROMPTS[2], SEEDED)  # joins the step that fails, as a prefill
    if where == "execute":
        original = engine.runner.execute

        def execute(chunks):
            engine.runner.execute = original  # fails once
            raise RuntimeError("device fell over")

        engine.runner.execute = execute
    else:

        def hook(layer, batch):
            engine.set_layer_hook(None)
            raise RuntimeError("device fell over")

        engine.set_layer_hook(hook)
    outputs = engine.step()
    assert sorted(o.request_id for o in outputs) == sorted([*ids, late])
    for output in outputs:
        assert output.finished and output.finish_reason == FinishReason.ERROR and output.error_code == "worker_error"
        assert "RuntimeError" in output.error and "device fell over" in output.error
    assert not engine.requests and not engine.has_unfinished()
    engine.check_no_leaks()
    again = engine.generate(PROMPTS, [GREEDY, GREEDY, SEEDED])
    assert [r.token_ids for r in again] == [e.token_ids for e in expected]  # served token-exact afterwards
    assert [r.finish_reason for r in again] == ["length"] * 3
    engine.check_no_leaks()
