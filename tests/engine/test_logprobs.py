"""Log probabilities as a client gets them: for every generated token (its own and the top ones) and for every prompt
token after the first, equal to transformers' ``log_softmax(model(ids).logits)`` in float32, whatever the sampling
parameters, chunking, batch or hand-off."""

from __future__ import annotations

import pytest
import torch

from engine.request import RequestOutput, SamplingParams
from tests.helpers.engine import handoff, random_prompts

TOL = 1e-4


@pytest.fixture(scope="module")
def reference_logprobs(tiny_llama_path):
    """ids -> transformers' float32 ``log_softmax(model(ids).logits)`` ``[len(ids), vocab]``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()

    @torch.inference_mode()
    def logprobs(ids: list[int]) -> torch.Tensor:
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return logprobs


def _collect(engine, ids: list[str]) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {rid: [] for rid in ids}
    for _ in range(1000):
        if not engine.has_unfinished():
            break
        for output in engine.step():
            outputs[output.request_id].append(output)
    return outputs


def _check_entry(entry, expected_row: torch.Tensor, token: int, k: int) -> None:
    assert entry.token_id == token
    assert abs(entry.logprob - float(expected_row[token])) < TOL
    top = torch.topk(expected_row, k)
    assert [t for t, _ in entry.top] == top.indices.tolist()
    assert all(abs(v - e) < TOL for (_, v), e in zip(entry.top, top.values.tolist()))
    assert all(isinstance(v, float) for _, v in entry.top) and isinstance(entry.logprob, float)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5),
        # the values are the model's own distribution: temperature, top-k, penalties and bias do not change them
        SamplingParams(
            max_tokens=12,
            temperature=1.4,
            top_k=20,
            seed=3,
            ignore_eos=True,
            logprobs=3,
            presence_penalty=1.5,
            repetition_penalty=1.2,
            logit_bias={65: 5.0},
        ),
    ],
    ids=["greedy", "sampled"],
)
def test_token_logprobs_match_transformers(tiny_llama_path, make_engine, reference_logprobs, params):
    engine = make_engine(tiny_llama_path)
    prompts = random_prompts(3, 5, 40, seed=2)
    plain = SamplingParams(max_tokens=12, temperature=0.8, ignore_eos=True)
    ids = [engine.add_request(p, sp, f"r{i}") for i, (p, sp) in enumerate(zip(prompts, [params, plain, params]))]
    outputs = _collect(engine, ids)
    assert all(o.logprobs is None for o in outputs["r1"])  # asked for none: none computed
    for rid, prompt in (("r0", prompts[0]), ("r2", prompts[2])):
        tokens = [t for o in outputs[rid] for t in o.new_token_ids]
        entries = [e for o in outputs[rid] for e in o.logprobs]
        assert len(tokens) == len(entries) == 12
        expected = reference_logprobs(prompt + tokens)
        for i, (token, entry) in enumerate(zip(tokens, entries)):
            _check_entry(entry, expected[len(prompt) - 1 + i], token, params.logprobs)
        assert all(o.prompt_logprobs is None for o in outputs[rid])
    engine.check_no_leaks()


def test_logprobs_zero_gives_the_chosen_token_only(tiny_llama_path, make_engine, reference_logprobs):
    engine = make_engine(tiny_llama_path)
    rid = engine.add_request([5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=0))
    outputs = _collect(engine, [rid])[rid]
    tokens = [t for o in outputs for t in o.new_token_ids]
    expected = reference_logprobs([5, 6, 7] + tokens)
    for i, output in enumerate(outputs):
        [entry] = output.logprobs
        assert entry.top == [] and abs(entry.logprob - float(expected[2 + i][tokens[i]])) < TOL
    engine.check_no_leaks()


@pytest.mark.parametrize("prefill_only", [False, True])
def test_prompt_logprobs_of_a_chunked_prompt(tiny_llama_path, make_engine, reference_logprobs, prefill_only):
    engine = make_engine(tiny_llama_path, max_batch_tokens=32)
    [prompt, other] = random_prompts(2, 100, 100, seed=4)  # longer than a step: computed in four chunks
    engine.generate([prompt], SamplingParams(max_tokens=2))  # its blocks are in the prefix cache now
    params = SamplingParams(max_tokens=1 if prefill_only else 4, temperature=0.0, prompt_logprobs=4, logprobs=2)
    rid = engine.add_request(prompt, params, "p", prefill_only=prefill_only)
    engine.add_request(other, SamplingParams(max_tokens=4, temperature=0.0), "o")  # shares the steps
    outputs = _collect(engine, ["p", "o"])
    first = outputs["p"][0]
    assert first.new_token_ids and first.num_cached_tokens == 0  # no prefix-cache hit: every position computed
    entries = first.prompt_logprobs
    assert entries is not None and len(entries) == len(prompt) and entries[0] is None
    expected = reference_logprobs(prompt)
    for j in range(1, len(prompt)):
        _check_entry(entries[j], expected[j - 1], prompt[j], 4)
    _check_entry(first.logprobs[0], expected[-1], first.new_token_ids[0], 2)
    assert all(o.prompt_logprobs is None for o in outputs["p"][1:] + outputs["o"])
    if prefill_only:
        engine.release(rid)
    engine.check_no_leaks()


def test_cached_tokens_are_reported_on_every_output(tiny_llama_path, make_engine):
    engine = make_engine(tiny_llama_path)
    [prompt] = random_prompts(1, 70, 70, seed=6)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    first = _collect(engine, [engine.add_request(prompt, params, "a")])["a"]
    assert all(o.num_cached_tokens == 0 for o in first)
    again = _collect(engine, [engine.add_request(prompt, params, "b")])["b"]
    assert all(o.num_cached_tokens == 64 for o in again)  # four full blocks of 16
    engine.check_no_leaks()


def test_logprobs_across_the_handoff(tiny_llama_path, make_engine, reference_logprobs):
    prefill = make_engine(tiny_llama_path, max_batch_tokens=32)
    decode = make_engine(tiny_llama_path)
    [prompt] = random_prompts(1, 50, 50, seed=8)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=1)
    outputs = handoff(prefill, decode, prompt, params, "h")
    first = outputs[0]
    assert len(first.logprobs) == 1 and len(first.prompt_logprobs) == len(prompt)  # with the prefill's token
    for output in outputs[1:]:  # the decode side's: one entry per token it sampled, no prompt logprobs again
        assert output.prompt_logprobs is None
        assert len(output.logprobs or []) == len(output.new_token_ids)
    tokens = [t for o in outputs for t in o.new_token_ids]
    entries = [e for o in outputs for e in o.logprobs or []]
    expected = reference_logprobs(prompt + tokens)
    for i, (token, entry) in enumerate(zip(tokens, entries, strict=True)):
        _check_entry(entry, expected[len(prompt) - 1 + i], token, 3)
    for j in range(1, len(prompt)):
        _check_entry(first.prompt_logprobs[j], expected[j - 1], prompt[j], 1)
    prefill.check_no_leaks()
    decode.check_no_leaks()
