"""Speculative decoding served: a decode pool with ``speculative:`` streams what the same cluster streams for a request
that opts out (``speculative: false``), its several-token steps arrive as chunks naming their tokens, the timing is
reported, and /metrics counts proposals; with n-gram proposals, and with the model as its own draft."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from cluster.run.launch import start_serving
from tests.helpers.cluster import tiny_cluster_config, wait_all_kv_free

pytestmark = pytest.mark.timeout(300)
# prompts a random tiny model falls into loops after, so n-gram proposals are made and some are kept
PROMPTS = [[3, 4, 5, 6] * 6, [90, 11] * 9 + [5], [30, 31, 32] * 4]


# a draft model in make test-e2e (the suite's 20 minutes): the engine's tests check its tokens
@pytest.fixture(
    scope="module", params=["disaggregated", "colocated", pytest.param("disaggregated-draft", marks=pytest.mark.e2e)]
)
def server(request, ray_local, tiny_llama_path):
    speculative = {"method": "ngram", "num_tokens": 4, "ngram_max": 3}
    if request.param.endswith("draft"):  # the model as its own draft: most proposals kept
        speculative = {"method": "draft", "num_tokens": 4, "draft_model": str(tiny_llama_path), "draft_kv_memory_mb": 2}
    pools = {"decode": {"replicas": 1, "torch_threads": 1, "kv_blocks": 160, "speculative": speculative}}
    mode = request.param.split("-")[0]
    if mode == "colocated":
        pools["prefill"] = {"replicas": 0}
    handle = start_serving(tiny_cluster_config(tiny_llama_path, mode, pools=pools))
    yield handle
    handle.stop()


def _metric(text: str, key: str) -> float:
    values = re.findall(rf'pdserve_worker_total{{[^}}]*key="{key}"[^}}]*}} ([0-9.e+]+)', text)
    return sum(float(v) for v in values)


def _stream(url: str, body: dict) -> tuple[str, list[list[str]], list[float], dict]:
    """The streamed text, each chunk's tokens, every token's logprob and the final chunk's timing."""
    with httpx.stream("POST", url, json=body | {"stream": True, "logprobs": 0}, timeout=120) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    data = [json.loads(e) for e in events[:-1]]
    chunks = [d["choices"][0] for d in data if d["choices"]]
    named = [c["logprobs"] for c in chunks if c.get("logprobs")]
    logprobs = [v for lp in named for v in lp["token_logprobs"]]
    return "".join(c["text"] for c in chunks), [lp["tokens"] for lp in named], logprobs, data[-1].get("timing", {})


def test_greedy_streams_are_unchanged_and_metrics_count(server):
    url = f"{server.base_url}/v1/completions"
    model = server.config.served_model_name
    for prompt in PROMPTS:
        body = {"model": model, "prompt": prompt, "max_tokens": 80, "temperature": 0, "ignore_eos": True}
        text, chunks, logprobs, timing = _stream(url, body)
        # opted out: what the same cluster gives without speculation
        want_text, want_chunks, want_logprobs, want_timing = _stream(url, body | {"speculative": False})
        assert text == want_text and sum(chunks, []) == sum(want_chunks, []) and len(sum(chunks, [])) == 80
        # a verified position is computed in a multi-token forward: equal up to float32 rounding
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4)
        # the decode worker's figures come with its first decoded token, which may arrive with others
        assert set(timing) == set(want_timing) and timing["ttft_s"] > 0
        whole = httpx.post(url, json=body, timeout=120).json()
        assert whole["choices"][0]["text"] == want_text and whole["usage"]["completion_tokens"] == 80
    wait_all_kv_free(server.base_url)
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    # some steps kept proposed tokens, and sent several tokens at once
    assert _metric(metrics, "spec_proposed_tokens") >= _metric(metrics, "spec_accepted_tokens") > 0
    lengths = re.findall(r'pdserve_spec_mean_accepted_length{pool="(\w+)",worker="[^"]+"} ([0-9.]+)', metrics)
    assert lengths and all(pool != "prefill" and float(v) > 1.0 for pool, v in lengths)  # verifying workers only
