"""Sampling parameters as a client sees them: min_p, min_tokens, presence / frequency / repetition penalties,
logit_bias, skip_special_tokens, and the batched sampler's draws, checked against a plain one-row-at-a-time
reference (and, end to end, against transformers' logits); out-of-range values are refused naming the field."""

from __future__ import annotations

import collections

import pytest
import torch

from engine.request import GuidedDecoding, Request, RequestTiming, SamplingParams
from engine.sampler import Sampler, seed_for_position

EOS = 3


# ---- the reference: one row at a time, written the obvious way --------------------------------------------------------


def reference_processed(logits: torch.Tensor, request: Request, eos: set[int]) -> torch.Tensor:
    """min_tokens, logit_bias, repetition / presence / frequency penalties, in vLLM's order, by plain loops."""
    p = request.params
    x = logits.clone()
    for token, bias in p.logit_bias.items():
        x[token] += bias
    if p.repetition_penalty != 1.0:
        for token in set(request.prompt_token_ids + request.output_token_ids):
            x[token] = x[token] / p.repetition_penalty if x[token] > 0 else x[token] * p.repetition_penalty
    for token, count in collections.Counter(request.output_token_ids).items():
        x[token] -= p.presence_penalty + p.frequency_penalty * count
    if len(request.output_token_ids) < p.min_tokens:
        for token in set(p.stop_token_ids) | (set() if p.ignore_eos else eos):
            x[token] = float("-inf")
    return x


def reference_probs(processed: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    scores = processed / p.temperature
    if p.min_p > 0:
        probs = torch.softmax(scores, dim=-1)
        scores[probs < probs.max() * p.min_p] = float("-inf")
    order = torch.argsort(scores, descending=True, stable=True)
    keep = torch.ones_like(scores, dtype=torch.bool)
    if 0 < p.top_k < len(scores):
        keep &= scores >= scores[order[p.top_k - 1]]
    masked = scores.masked_fill(~keep, float("-inf"))
    probs, covered = torch.softmax(masked, dim=-1), 0.0
    for rank, token in enumerate(order.tolist()):
        if p.top_p < 1.0 and rank > 0 and covered >= p.top_p:
            masked[token] = float("-inf")
        covered += float(probs[token])
    return torch.softmax(masked, dim=-1)


def reference_seeded_token(probs: torch.Tensor, seed: int, position: int) -> int:
    generator = torch.Generator().manual_seed(seed_for_position(seed, position))
    q = -torch.log(torch.rand(probs.shape, generator=generator))  # Exp(1)
    return int((probs / q).argmax())


def _with(params: SamplingParams, **changes) -> SamplingParams:
    copy = params.copy()
    for name, value in changes.items():
        setattr(copy, name, value)
    return copy


def _request(i: int, params: SamplingParams, prompt=None, output=None) -> Request:
    request = Request(str(i), prompt or [1, 2, 5, 5, 9], params, RequestTiming(0.0))
    request.output_token_ids = list(output or [])
    return request


def _random_params(rng: torch.Generator, vocab: int, seed: int) -> SamplingParams:
    def pick(*options):
        return options[int(torch.randint(len(options), (1,), generator=rng))]

    return SamplingParams(
        temperature=pick(0.0, 0.5, 1.0, 1.7),
        top_k=pick(0, 1, 5, 40),
        top_p=pick(1.0, 0.9, 0.5),
        min_p=pick(0.0, 0.0, 0.1),
        seed=seed,
        presence_penalty=pick(0.0, 0.0, 1.5, -1.0),
        frequency_penalty=pick(0.0, 0.0, 0.7),
        repetition_penalty=pick(1.0, 1.0, 1.3, 0.8),
        logit_bias=pick({}, {}, {7: 4.0, 11: -100.0}),
        min_tokens=pick(0, 0, 3),
        stop_token_ids=pick([], [13]),
        ignore_eos=pick(False, True),
    )


def test_batched_sampler_equals_the_row_by_row_reference():
    """Every mix of parameters in one batch: greedy rows take the processed argmax, seeded rows draw exactly what
    the reference draws from the reference distribution at their seed and output position."""
    vocab, rng = 97, torch.Generator().manual_seed(0)
    sampler = Sampler([EOS])
    checked = collections.Counter()
    for trial in range(30):
        rows = 24
        logits = torch.randn(rows, vocab, generator=rng) * 3
        requests = []
        for i in range(rows):
            output = torch.randint(vocab, (int(torch.randint(0, 6, (1,), generator=rng)),), generator=rng).tolist()
            prompt = torch.randint(vocab, (4,), generator=rng).tolist()
            requests.append(_request(i, _random_params(rng, vocab, seed=1000 * trial + i), prompt, output))
        result = sampler.sample(logits.clone(), requests)
        for i, request in enumerate(requests):
            processed = reference_processed(logits[i], request, {EOS})
            if request.params.greedy:
                expected = int(processed.argmax())
                checked["greedy"] += 1
            else:
                probs = reference_probs(processed, request.params)
                expected = reference_seeded_token(probs, request.params.seed, len(request.output_token_ids))
                assert probs[expected] > 0
                checked["sampled"] += 1
            assert result.token_ids[i] == expected and result.errors[i] is None, (trial, i, request.params)
    assert checked["greedy"] > 100 and checked["sampled"] > 400


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=6),
        SamplingParams(temperature=1.3, top_p=0.6),
        SamplingParams(temperature=1.0, min_p=0.2),
        SamplingParams(temperature=0.9, top_k=10, top_p=0.8, min_p=0.05),
    ],
    ids=["plain", "top_k", "top_p", "min_p", "all"],
)
def test_unseeded_draws_follow_the_distribution(params):
    """4000 rows of the same logits in one batch, each one draw from the engine's generator: the frequencies match
    the reference distribution and nothing outside its support is ever drawn."""
    vocab = 40
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(1)) * 2
    probs = reference_probs(logits.clone(), params)
    rows = 4000
    requests = [_request(i, params) for i in range(rows)]
    result = Sampler().sample(logits.expand(rows, vocab).clone(), requests)
    counts = torch.bincount(torch.tensor(result.token_ids), minlength=vocab).double() / rows
    assert set(torch.nonzero(counts).flatten().tolist()) <= set(torch.nonzero(probs).flatten().tolist())
    assert 0.5 * float((counts - probs).abs().sum()) < 0.05  # total variation distance


def test_seeded_draw_does_not_depend_on_the_batch():
    vocab = 64
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(2))
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42)
    alone = Sampler().sample(logits[3:4].clone(), [_request(0, seeded, output=[1, 2])]).token_ids[0]
    mixed = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.5, top_k=3, logit_bias={4: 10.0}),
        SamplingParams(temperature=1.0, presence_penalty=2.0),
        seeded,
        SamplingParams(temperature=1.1, min_p=0.3, seed=7),
    ]
    rows = [logits[0], logits[1], logits[2], logits[3], logits[4]]
    requests = [_request(i, p, output=[1, 2]) for i, p in enumerate(mixed)]
    in_batch = Sampler().sample(torch.stack(rows), requests).token_ids[3]
    assert in_batch == alone
    # the position is part of the seed: another output position draws from another stream
    draws = {
        Sampler().sample(logits[3:4].clone(), [_request(0, seeded, output=[1] * n)]).token_ids[0] for n in range(30)
    }
    assert len(draws) > 3


def test_plain_greedy_batch_is_the_argmax():
    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(3))
    result = Sampler([EOS]).sample(logits.clone(), [_request(i, SamplingParams(temperature=0.0)) for i in range(16)])
    assert result.token_ids == logits.argmax(dim=-1).tolist() and result.errors == [None] * 16
    assert result.logprobs == [None] * 16 and result.prompt_logprobs == {}


def test_masks_that_leave_nothing_fail_only_their_row():
    vocab = 8
    logits = torch.full((2, vocab), float("-inf"))
    logits[:, EOS] = 0.0  # EOS is the only possible token
    params = SamplingParams(temperature=0.0, min_tokens=2)
    result = Sampler([EOS]).sample(logits.clone(), [_request(0, params), _request(1, SamplingParams(temperature=0.0))])
    assert result.token_ids == [None, EOS]
    assert "nothing to sample" in result.errors[0] and result.errors[1] is None


# ---- end to end on the tiny model ------------------------------------------------------------------------------------


def test_min_tokens_holds_eos_and_stop_ids_back(tiny_llama_path, make_engine):
    engine = make_engine(tiny_llama_path)
    eos = min(engine.eos_token_ids)
    forced_eos = SamplingParams(max_tokens=20, temperature=0.0, logit_bias={eos: 100.0})
    [at_once] = engine.generate(["hello"], forced_eos)
    assert at_once.token_ids == [eos] and at_once.finish_reason == "stop"
    forced_eos.min_tokens = 5
    [held] = engine.generate(["hello"], forced_eos)
    assert len(held.token_ids) == 6 and held.token_ids[-1] == eos and eos not in held.token_ids[:-1]
    assert held.finish_reason == "stop"
    stopper = 65  # "b" in the byte tokenizer's alphabet order
    forced_stop = SamplingParams(max_tokens=20, temperature=0.9, seed=1, stop_token_ids=[stopper], min_tokens=3)
    forced_stop.logit_bias = {stopper: 100.0}
    [stopped] = engine.generate(["hello"], forced_stop)
    assert len(stopped.token_ids) == 4 and stopped.token_ids[-1] == stopper and stopped.finish_reason == "stop"
    engine.check_no_leaks()


def test_penalized_greedy_matches_transformers_step_by_step(tiny_llama_path, make_engine, llama_reference):
    """The engine's penalized greedy tokens are the argmax of the reference processing of transformers' logits at
    every position: penalties on the right tokens, counted over the right history."""
    engine = make_engine(tiny_llama_path)
    prompt = engine.tokenize("penalties: abcabcabc")
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logit_bias={68: 6.0})
    variants = [
        _with(greedy, repetition_penalty=1.5, logit_bias={}),
        _with(greedy, frequency_penalty=2.0),
        _with(greedy, presence_penalty=2.0, frequency_penalty=0.5),
        _with(greedy, repetition_penalty=0.7, logit_bias={66: 2.0}),
    ]
    [plain, biased] = engine.generate([prompt] * 2, [_with(greedy, logit_bias={}), greedy])
    assert biased.token_ids.count(68) > 12  # the bias alone repeats its token
    results = engine.generate([prompt] * 4, variants)
    assert results[0].token_ids != plain.token_ids and results[3].token_ids != plain.token_ids
    assert all(r.token_ids.count(68) < 5 for r in results[1:3])  # the output penalties stop the repetition
    for params, result in zip(variants, results):
        with torch.inference_mode():
            logits = llama_reference.model(torch.tensor([prompt + result.token_ids])).logits[0].float()
        for i, token in enumerate(result.token_ids):
            request = _request(0, params, prompt, result.token_ids[:i])
            expected = reference_processed(logits[len(prompt) - 1 + i], request, engine.eos_token_ids)
            assert token == int(expected.argmax()), (params, i)
    engine.check_no_leaks()


def test_skip_special_tokens_false_keeps_their_text(tiny_llama_path, make_engine):
    engine = make_engine(tiny_llama_path)
    special = engine.tokenizer.convert_tokens_to_ids("<|im_start|>")
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logit_bias={special: 100.0})
    [skipped] = engine.generate(["hi"], params)
    params.skip_special_tokens = False
    [kept] = engine.generate(["hi"], params)
    assert skipped.token_ids == kept.token_ids == [special] * 3
    assert skipped.text == "" and kept.text == "<|im_start|>" * 3
    engine.check_no_leaks()


# ---- validation --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params, field",
    [
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=17, max_tokens=16), "min_tokens"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-2.01), "frequency_penalty"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={"5": 1.0}), "logit_bias"),
        (dict(logit_bias={5: 101.0}), "logit_bias"),
        (dict(logit_bias={10**6: 1.0}), "logit_bias"),  # beyond the model's vocabulary
        (dict(logprobs=21), "logprobs"),
        (dict(logprobs=-1), "logprobs"),
        (dict(prompt_logprobs=21), "prompt_logprobs"),
        (dict(skip_special_tokens=None), "skip_special_tokens"),
        (dict(guided=GuidedDecoding("yaml", "x")), "guided"),  # type: ignore[arg-type]
        (dict(guided=GuidedDecoding("regex", "")), "guided"),
    ],
)
def test_out_of_range_params_name_the_field(tiny_llama_path, make_engine, params, field):
    engine = make_engine(tiny_llama_path)
    with pytest.raises(ValueError) as info:
        engine.add_request("hello", SamplingParams(**params))
    assert str(info.value).split()[0] == field
    assert engine.generate(["still serving"], SamplingParams(max_tokens=2))[0].token_ids
    engine.check_no_leaks()


def test_prefill_only_copy_may_have_min_tokens_above_its_one_token(tiny_llama_path, make_engine):
    """The prefill worker sets max_tokens to 1; the request's min_tokens still masks EOS for its first token."""
    engine = make_engine(tiny_llama_path)
    eos = min(engine.eos_token_ids)
    params = SamplingParams(max_tokens=1, temperature=0.0, min_tokens=4, logit_bias={eos: 100.0})
    rid = engine.add_request("hello", params, prefill_only=True)
    [first] = [o for _ in range(5) for o in engine.step()]
    assert first.new_token_ids[0] != eos
    engine.release(rid)
    engine.check_no_leaks()
