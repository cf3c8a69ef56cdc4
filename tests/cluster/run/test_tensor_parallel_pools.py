"""Tensor-parallel workers behind the real router and API: ``pools.<pool>.tensor_parallel_size`` N runs one worker as
N ranks (threads in-process, Ray actors in one STRICT_PACK placement group), token-exact against N = 1 on the tiny
model; a rank that dies fails the requests of that step at once and the pool restarts all the ranks together.

Exactness: the ranks' partial sums are added by an all-reduce (another summation order than one matmul), so greedy
tokens must be equal and each chosen token's logprob within 1e-4; the gap is printed.
"""

from __future__ import annotations

import httpx
import pytest

from cluster.config import ConfigError
from tests.helpers.cluster import tiny_cluster_config, wait_all_kv_free, wait_until

LOGPROB_TOLERANCE = 1e-4
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


def _config(model_path, tp: int, **sections):
    pool = {"replicas": 1, "torch_threads": 1, "kv_blocks": 96, "tensor_parallel_size": tp}
    return tiny_cluster_config(
        model_path, mode="colocated", pools={"prefill": {"replicas": 0}, "decode": pool}, **sections
    )


def _disaggregated(model_path, prefill_tp: int, decode_tp: int, backend: str):
    def pool(tp: int) -> dict:
        return {"replicas": 1, "torch_threads": 1, "kv_blocks": 96, "tensor_parallel_size": tp}

    return tiny_cluster_config(
        model_path,
        pools={"prefill": pool(prefill_tp), "decode": pool(decode_tp)},
        transfer={"backend": backend, "deadline_s": 20, "lease_s": 20},
        # every request through a prefill worker: none is short enough to be computed on the decode side
        router={"port": 0, "local_prefill_max_tokens": 0},
    )


def _complete(handle, prompt: str, max_tokens: int = 12, cached_tokens: list[int] | None = None) -> tuple[str, list]:
    """The text and chosen tokens' logprobs; the prompt tokens the server reports cached go to ``cached_tokens``."""
    cached_tokens = [] if cached_tokens is None else cached_tokens
    body = {
        "model": handle.config.served_model_name,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 1,
    }
    response = httpx.post(f"{handle.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    cached_tokens.append(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    return choice["text"], choice["logprobs"]["token_logprobs"]


def _serve_all(config, prompts: list[str]) -> tuple[dict, list[dict], int]:
    """Each prompt twice (the second time its prefix cached), the ranks' infos and the cached tokens reported."""
    from cluster.run.launch import start_serving

    handle = start_serving(config, in_process=True)
    cached: list[int] = []
    try:
        outputs = {p: _complete(handle, p, cached_tokens=cached) for p in prompts}
        outputs |= {
            p + " again": _complete(handle, p, cached_tokens=cached) for p in prompts
        }  # the prefix cache reused on every rank
        wait_all_kv_free(handle.base_url)
        assert not handle.router.flows
        ranks = [rank.rank for record in handle.pools.workers for rank in record.ranks]
        assert all(not record.info.get("error") for record in handle.pools.workers)
    finally:
        handle.stop()
    infos = [rank.info() for rank in ranks]
    assert all(info["ended"] == "stop" for info in infos)  # every rank was stopped by its rank 0, none broke
    return outputs, infos, sum(cached)


def _same_tokens_gap(expected: dict, got: dict) -> float:
    """Asserts every prompt's text is the same; the largest gap between the chosen tokens' logprobs."""
    gap = 0.0
    for prompt, (text, logprobs) in expected.items():
        assert got[prompt][0] == text, prompt
        gap = max(gap, max(abs(a - b) for a, b in zip(logprobs, got[prompt][1], strict=True)))
    return gap


@pytest.fixture(scope="module")
def colocated_two_ranks(tiny_llama_path):
    return _serve_all(_config(tiny_llama_path, 2), PROMPTS)


def test_two_ranks_serve_the_same_tokens_as_one(tiny_llama_path, colocated_two_ranks):
    one, _, _ = _serve_all(_config(tiny_llama_path, 1), PROMPTS)
    two, ranks, _ = colocated_two_ranks
    gap = _same_tokens_gap(one, two)
    print(f"largest logprob gap at 2 ranks: {gap:.3g}")
    assert gap < LOGPROB_TOLERANCE
    [rank1] = ranks
    assert rank1["kv_heads"] == 1  # the tiny model's 2 KV heads, one per rank
    assert rank1["steps"] > 0 and not rank1["serving"] and rank1["ended"] == "stop"  # rank 0's stop ended it


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "backend"), [(2, 1, "zmq"), (1, 2, "shm"), (2, 2, "gloo")])
def test_disaggregated_degrees_serve_what_colocated_ranks_do(
    tiny_llama_path, colocated_two_ranks, prefill_tp, decode_tp, backend
):
    """Each prefill rank sends its KV heads to the decode ranks that hold them (worker/rank_kv.py), so any two
    degrees and any transfer backend give the colocated worker's tokens; the repeated prompts reuse the decode
    worker's prefix cache across the hand-off."""
    colocated, _, _ = colocated_two_ranks
    disaggregated, ranks, cached = _serve_all(_disaggregated(tiny_llama_path, prefill_tp, decode_tp, backend), PROMPTS)
    gap = _same_tokens_gap(colocated, disaggregated)
    print(f"({prefill_tp}, {decode_tp}) over {backend}: largest logprob gap against colocated at 2 ranks: {gap:.3g}")
    assert gap < LOGPROB_TOLERANCE
    assert len(ranks) == prefill_tp - 1 + decode_tp - 1 and all(rank["steps"] > 0 for rank in ranks)
    assert cached > 0


def test_a_degree_that_does_not_divide_the_heads_is_a_config_error(tiny_llama_path):
    from cluster.run.launch import start_serving

    with pytest.raises(
        ConfigError, match=r"pools\.decode\.tensor_parallel_size: tensor_parallel_size 3 does not divide"
    ):
        start_serving(_config(tiny_llama_path, 3), in_process=True)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_on_ray_a_dead_rank_fails_its_step_and_the_ranks_restart_together(tiny_llama_path):
    import ray

    from cluster.run.launch import start_serving

    if ray.is_initialized():
        ray.shutdown()
    handle = start_serving(_config(tiny_llama_path, 2))
    try:
        expected, _ = _complete(handle, PROMPTS[0])
        [record] = handle.pools.workers
        old_pids = [record.info["pid"], *(rank["pid"] for rank in record.info["ranks"])]
        assert len(set(old_pids)) == 2  # two processes, one per rank

        ray.kill(record.ranks[0], no_restart=True)
        body = {"model": handle.config.served_model_name, "prompt": PROMPTS[1], "max_tokens": 200}
        failed = httpx.post(f"{handle.base_url}/v1/completions", json=body, timeout=60)
        # the step fails at once (500, the gloo error named), or the worker is already out of the pool (503)
        assert failed.status_code in (500, 503), failed.text
        assert failed.json()["error"]["message"]

        wait_until(lambda: record.restarts == 1 and not record.restarting, timeout_s=120, step_s=0.5)
        new_pids = [record.info["pid"], *(rank["pid"] for rank in record.info["ranks"])]
        assert not set(new_pids) & set(old_pids)  # both ranks are new processes

        def serves() -> bool:
            body = {"model": handle.config.served_model_name, "prompt": "hi", "max_tokens": 2}
            return httpx.post(f"{handle.base_url}/v1/completions", json=body, timeout=60).status_code == 200

        wait_until(serves, timeout_s=60, step_s=0.5)
        assert _complete(handle, PROMPTS[0])[0] == expected
        wait_all_kv_free(handle.base_url)
    finally:
        handle.stop()
