"""Sampling through HTTP with the official ``openai`` client, in both modes: n choices, log probabilities (against
transformers' own log_softmax), echo, prompt lists, penalties, logit_bias, min_tokens, seeds and the model's
generation_config defaults.

Every check is what a client sees; the references are computed here from the same tiny float32 model with
transformers. Each module's clusters end with every KV block free and no request held (``Clusters.close``).
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter

import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer

from tests.helpers.cluster import metric_value, wait_all_kv_free, wait_until
from tests.helpers.engine import Reference
from tests.helpers.openai_api import MODES, client, model_folder, model_name

pytestmark = pytest.mark.timeout(300)

TOL = 1e-4  # float32 engine vs float32 transformers


@pytest.fixture(scope="module", params=MODES)
def server(request, clusters, tiny_llama_path):
    return clusters.get(tiny_llama_path, request.param)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_path):
    return AutoTokenizer.from_pretrained(tiny_llama_path)


@pytest.fixture(scope="module")
def reference(tiny_llama_path):
    return Reference(tiny_llama_path)


@torch.inference_mode()
def log_softmax(reference: Reference, ids: list[int]) -> torch.Tensor:
    """Row i: the model's log probabilities for the token after ids[: i + 1]."""
    return torch.log_softmax(reference.model(torch.tensor([ids])).logits[0].float(), dim=-1)


def _create(handle, **kwargs):
    return client(handle).completions.create(model=model_name(handle), **kwargs)


def _chat(handle, **kwargs):
    return client(handle).chat.completions.create(model=model_name(handle), **kwargs)


# ---- n ---------------------------------------------------------------------------------------------------------


def test_n_choices_are_distinct_indexed_and_all_finish(server):
    response = _create(server, prompt="once upon", n=3, max_tokens=12, temperature=1.0, extra_body={"ignore_eos": True})
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert len({c.text for c in response.choices}) == 3
    assert all(c.finish_reason == "length" for c in response.choices)
    assert response.usage.completion_tokens == 36 and response.usage.prompt_tokens == len("once upon")

    chat = _chat(server, messages=[{"role": "user", "content": "hi"}], n=3, max_tokens=8, temperature=1.0)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert len({c.message.content for c in chat.choices}) == 3


def test_choice_j_draws_with_seed_plus_j_streamed_or_not(server):
    """Choice j of a seeded request is the request with seed + j; streaming gives the same choices, each chunk
    naming its choice, every choice finishing, and the usage counting the prompt once."""
    args = {"prompt": "seeded", "max_tokens": 10, "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    whole = _create(server, n=3, seed=41, **args)
    singles = [_create(server, seed=41 + j, **args).choices[0].text for j in range(3)]
    assert [c.text for c in whole.choices] == singles

    texts, finishes = {0: "", 1: "", 2: ""}, {}
    usage = None
    for chunk in _create(server, n=3, seed=41, stream=True, stream_options={"include_usage": True}, **args):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finishes[choice.index] = choice.finish_reason
    assert [texts[j] for j in range(3)] == singles
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert usage.completion_tokens == 30 and usage.prompt_tokens == len("seeded")


def test_n_streamed_chat_gives_each_choice_its_role_text_and_finish(server):
    stream = _chat(
        server, messages=[{"role": "user", "content": "go"}], n=2, max_tokens=6, temperature=1.0, stream=True
    )
    roles, texts, finishes = set(), {0: "", 1: ""}, {}
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.role:
                roles.add(choice.index)
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert roles == {0, 1} and set(finishes) == {0, 1} and texts[0] != texts[1]


# ---- logprobs --------------------------------------------------------------------------------------------------


def test_completion_logprobs_and_echo_equal_transformers(server, tokenizer, reference):
    prompt = tokenizer("the quick brown fox").input_ids
    generated = reference.greedy(prompt, 6)
    expected = log_softmax(reference, prompt + generated)
    response = _create(
        server, prompt=prompt, max_tokens=6, temperature=0, logprobs=5, echo=True, extra_body={"ignore_eos": True}
    )
    choice = response.choices[0]
    everything = prompt + generated
    assert choice.text == tokenizer.decode(prompt) + tokenizer.decode(generated)
    logprobs = choice.logprobs
    assert logprobs.tokens == [tokenizer.decode([t]) for t in everything]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(everything))]
    for pos in range(1, len(everything)):
        row = expected[pos - 1]
        assert abs(logprobs.token_logprobs[pos] - row[everything[pos]].item()) < TOL, pos
        top = torch.topk(row, 5)
        allowed = set(top.indices.tolist()) | {everything[pos]}
        tops = logprobs.top_logprobs[pos]
        assert 1 <= len(tops) <= 6
        for token, value in tops.items():  # several byte tokens decode to the same "\ufffd": any of them may match
            assert any(tokenizer.decode([t]) == token and abs(row[t].item() - value) < TOL for t in allowed), token
        assert abs(max(tops.values()) - top.values[0].item()) < TOL

    # streamed: each chunk carries its own tokens' entries (the echoed prompt's with the first), in order
    args = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 5, "echo": True}
    text, tokens, values, offsets = "", [], [], []
    for chunk in _create(server, stream=True, extra_body={"ignore_eos": True}, **args):
        for part in chunk.choices:
            text += part.text
            if part.logprobs is not None:
                tokens += part.logprobs.tokens
                values += part.logprobs.token_logprobs
                offsets += part.logprobs.text_offset
    assert text == choice.text and tokens == logprobs.tokens and offsets == logprobs.text_offset
    assert values[0] is None and all(abs(a - b) < TOL for a, b in zip(values[1:], logprobs.token_logprobs[1:]))


def test_chat_logprobs_equal_transformers_streamed_or_not(server, tokenizer, reference):
    messages = [{"role": "user", "content": "count"}]
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])
    generated = reference.greedy(prompt, 5)
    expected = log_softmax(reference, prompt + generated)
    args = {"messages": messages, "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    response = _chat(server, extra_body={"ignore_eos": True}, **args)
    content = response.choices[0].logprobs.content
    assert len(content) == 5
    for i, entry in enumerate(content):
        row = expected[len(prompt) + i - 1]
        assert entry.token == tokenizer.decode([generated[i]]) and entry.bytes == list(entry.token.encode())
        assert abs(entry.logprob - row[generated[i]].item()) < TOL
        top = torch.topk(row, 3)
        assert [t.token for t in entry.top_logprobs] == [tokenizer.decode([t]) for t in top.indices.tolist()]
        assert all(abs(t.logprob - v) < TOL for t, v in zip(entry.top_logprobs, top.values.tolist()))

    streamed = []
    for chunk in _chat(server, stream=True, extra_body={"ignore_eos": True}, **args):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                streamed.extend(choice.logprobs.content)
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in content]


# ---- prompt lists ----------------------------------------------------------------------------------------------


def test_a_prompt_list_gives_one_choice_per_prompt_in_order(server, tokenizer):
    prompts = ["alpha", "be", "gamma ray"]
    greedy = {"max_tokens": 5, "temperature": 0, "extra_body": {"ignore_eos": True}}
    singles = [_create(server, prompt=p, **greedy).choices[0].text for p in prompts]
    response = _create(server, prompt=prompts, n=2, **greedy)
    assert [c.index for c in response.choices] == list(range(6))
    assert [c.text for c in response.choices] == [s for s in singles for _ in range(2)]
    assert response.usage.prompt_tokens == sum(len(p) for p in prompts)
    assert response.usage.completion_tokens == 30

    ids = [tokenizer(p).input_ids for p in prompts]
    by_ids = _create(server, prompt=ids, **greedy)
    assert [c.text for c in by_ids.choices] == singles


# ---- penalties, bias, min_tokens -------------------------------------------------------------------------------


@torch.inference_mode()
def penalized_greedy(reference: Reference, prompt: list[int], steps: int, **penalties) -> list[int]:
    """The greedy continuation under OpenAI/vLLM penalties, one full forward per step: repetition (prompt and
    output tokens, CTRL), then frequency and presence (output tokens)."""
    rep = penalties.get("repetition_penalty", 1.0)
    out: list[int] = []
    for _ in range(steps):
        logits = reference.model(torch.tensor([prompt + out])).logits[0, -1].float()
        seen = torch.tensor(sorted(set(prompt + out)))
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / rep, values * rep)
        for token, count in Counter(out).items():
            logits[token] -= penalties.get("frequency_penalty", 0.0) * count + penalties.get("presence_penalty", 0.0)
        out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize(
    "penalties",
    [{"repetition_penalty": 1.8}, {"frequency_penalty": 1.5}, {"presence_penalty": 2.0, "frequency_penalty": 0.5}],
    ids=["repetition", "frequency", "presence+frequency"],
)
def test_penalties_change_the_greedy_text_as_the_reference_does(server, tokenizer, reference, penalties):
    prompt = tokenizer("aaaa bbbb aaaa").input_ids
    plain = reference.greedy(prompt, 16)
    expected = penalized_greedy(reference, prompt, 16, **penalties)
    assert expected != plain  # the penalty matters for this prompt, so the check below means something
    extra = {"ignore_eos": True, **{k: v for k, v in penalties.items() if k == "repetition_penalty"}}
    openai_args = {k: v for k, v in penalties.items() if k != "repetition_penalty"}
    response = _create(server, prompt=prompt, max_tokens=16, temperature=0, extra_body=extra, **openai_args)
    assert response.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)


def test_logit_bias_forces_a_token_and_min_tokens_holds_eos_back(server, tokenizer):
    x = tokenizer("x").input_ids[0]
    biased = _create(
        server,
        prompt="hello",
        max_tokens=10,
        temperature=1.0,
        logit_bias={str(x): 100},
        extra_body={"ignore_eos": True},
    )
    assert biased.choices[0].text == "x" * 10

    eos = {str(tokenizer.eos_token_id): 100}
    at_once = _create(server, prompt="hello", max_tokens=20, temperature=0, logit_bias=eos)
    assert at_once.choices[0].finish_reason == "stop" and at_once.choices[0].text == ""
    held = _create(server, prompt="hello", max_tokens=20, temperature=0, logit_bias=eos, extra_body={"min_tokens": 5})
    assert held.choices[0].finish_reason == "stop"
    assert held.usage.completion_tokens == at_once.usage.completion_tokens + 5
    assert len(held.choices[0].text) >= 1


# ---- seeds across modes, generation_config defaults ------------------------------------------------------------


def test_the_same_seed_gives_the_same_text_in_both_modes(clusters, tiny_llama_path):
    args = {"prompt": "a seeded story", "max_tokens": 16, "temperature": 1.0, "seed": 1234}
    texts = {}
    for mode in MODES:
        handle = clusters.get(tiny_llama_path, mode)
        texts[mode] = [c.text for c in _create(handle, n=2, extra_body={"ignore_eos": True}, **args).choices]
    assert texts["disaggregated"] == texts["colocated"]
    assert texts["colocated"][0] != texts["colocated"][1]


@pytest.mark.parametrize("mode", MODES)
def test_unset_sampling_fields_take_the_models_generation_config(clusters, tiny_llama_path, tmp_path_factory, mode):
    folder = tmp_path_factory.getbasetemp() / "tiny-llama-topk1"
    if not folder.exists():
        model_folder(tiny_llama_path, folder, generation_config={"top_k": 1, "temperature": 1.0})
    handle = clusters.get(folder, mode)
    args = {"prompt": "defaults", "max_tokens": 16, "extra_body": {"ignore_eos": True}}
    greedy = _create(handle, temperature=0, **args).choices[0].text
    assert _create(handle, seed=3, **args).choices[0].text == greedy  # top_k 1 from generation_config
    assert _create(handle, seed=3, top_p=None, **args).choices[0].text == greedy  # null is unset too
    sampled = {
        _create(handle, seed=s, extra_body={"ignore_eos": True, "top_k": 0}, prompt="defaults", max_tokens=16)
        .choices[0]
        .text
        for s in range(3)
    }
    assert sampled != {greedy}  # the request's own top_k wins


def test_logprobs_are_finite_numbers_when_sampling(server):
    response = _chat(
        server,
        messages=[{"role": "user", "content": "x"}],
        n=2,
        max_tokens=4,
        temperature=1.0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    for choice in response.choices:
        entries = choice.logprobs.content
        assert len(entries) == 4
        for entry in entries:
            assert math.isfinite(entry.logprob) and entry.logprob <= 0
            assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.logprob - TOL


# ---- one response, several requests: failure and cancellation ---------------------------------------------------


def _engines(handle):
    """The engines that take a request first (prefill or colocated workers): where a refusal is injected."""
    return [r.actor.worker.engine for r in handle.workers if r.role in ("prefill", "colocated")]


def test_one_failing_choice_fails_the_response_and_aborts_the_others(server):
    engines = _engines(server)

    def refusing(add_request):
        def add(prompt, params, request_id, *args, **kwargs):
            if request_id.endswith("-2"):  # the third choice
                raise ValueError("injected refusal")
            return add_request(prompt, params, request_id, *args, **kwargs)

        return add

    for engine in engines:
        engine.add_request = refusing(engine.add_request)
    try:
        body = {"prompt": "fail one", "n": 3, "max_tokens": 300, "extra_body": {"ignore_eos": True}}
        with pytest.raises(openai.BadRequestError, match="injected refusal"):
            _create(server, **body)
        wait_all_kv_free(server.base_url, timeout_s=10)
        assert not server.router.flows

        # streamed: 200 at the first token, then the error as the last event (the official client raises it)
        with pytest.raises(openai.APIError, match="injected refusal"):
            list(_create(server, stream=True, **body))
        raw = httpx.post(
            f"{server.base_url}/v1/completions",
            json={
                "model": model_name(server),
                "prompt": "fail one",
                "n": 3,
                "max_tokens": 300,
                "ignore_eos": True,
                "stream": True,
            },
            timeout=60,
        )
        events = [json.loads(line[6:]) for line in raw.text.split("\n\n") if line.startswith("data: {")]
        assert raw.status_code == 200 and raw.text.endswith("data: [DONE]\n\n")
        assert events[-1]["error"]["message"] == "injected refusal" and events[-1]["error"]["code"]
        assert not any(c["finish_reason"] for e in events[:-1] for c in e["choices"])
    finally:
        for engine in engines:
            del engine.add_request
    wait_all_kv_free(server.base_url, timeout_s=10)
    assert not server.router.flows


def test_a_client_leaving_mid_stream_aborts_every_choice(server):
    stream = _create(server, prompt="long", n=3, max_tokens=400, stream=True, extra_body={"ignore_eos": True})
    seen = set()
    for chunk in stream:
        seen.update(choice.index for choice in chunk.choices)
        if len(seen) == 3:
            break
    stream.close()
    gone = time.monotonic()
    while server.router.flows and time.monotonic() - gone < 5:
        time.sleep(0.02)
    assert not server.router.flows  # all three let go at the router...
    wait_all_kv_free(server.base_url, timeout_s=10)  # ...and on every worker, long before 400 tokens


def test_skip_special_tokens_false_keeps_them_in_the_text(server, tokenizer):
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    args = {"prompt": "special", "max_tokens": 3, "temperature": 0, "logit_bias": {str(start): 100}}
    kept = _create(server, extra_body={"ignore_eos": True, "skip_special_tokens": False}, **args)
    skipped = _create(server, extra_body={"ignore_eos": True}, **args)
    assert kept.choices[0].text == "<|im_start|>" * 3
    assert skipped.choices[0].text == "" and skipped.usage.completion_tokens == 3


def test_later_choices_go_where_the_first_one_computed_the_prompt(server):
    def affinity_picks() -> float:
        pools = ("prefill", "decode", "colocated")
        return sum(
            metric_value(server.base_url, "pdserve_routing_decisions_total", pool=p, reason="affinity") or 0
            for p in pools
        )

    def prefix_hits(pool: str) -> float:
        workers = server.router.members.workers.values()
        return sum(w.stats.counters.prefix_hit_tokens for w in workers if w.role == pool and w.stats is not None)

    pools = ("prefill", "decode") if server.config.mode == "disaggregated" else ("colocated",)
    before, hits_before = affinity_picks(), {pool: prefix_hits(pool) for pool in pools}
    prompt = "a shared prompt, never sent before. " * 8
    response = _create(server, prompt=prompt, n=3, max_tokens=4, temperature=1.0)
    assert affinity_picks() - before == 2 * len(pools)  # prefill and decode picks, or the colocated one
    # the prompt was computed once: the two later choices found its full blocks in the prefix cache of every worker
    # that holds it (disaggregated: the decode worker too, so their KV was not shipped again)
    block_size = server.config.transfer.block_size
    reusable = (response.usage.prompt_tokens - 1) // block_size * block_size
    for pool in pools:
        wait_until(lambda pool=pool: prefix_hits(pool) - hits_before[pool] >= 2 * reusable, timeout_s=5)
        assert prefix_hits(pool) - hits_before[pool] == 2 * reusable, pool
