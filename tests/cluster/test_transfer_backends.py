"""Prefill in one process, decode in another, the KV streamed layer by layer over each backend: the tokens equal
single-engine generation, and the bytes that moved are exactly the prompt's KV blocks."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from cluster.run.launch import start_serving
from tests.helpers.cluster import tiny_cluster_config, wait_all_kv_free
from tests.helpers.engine import Reference, random_prompts

pytestmark = pytest.mark.timeout(300)

BLOCK_BYTES = 16 * 2 * 3 * 2 * 16 * 4  # tokens x (K,V) x layers x kv heads x head dim x float32


@pytest.mark.parametrize(
    "backend, transport, stream_layers",
    [
        ("zmq", "tcp", True),
        ("zmq", "ipc", True),
        ("gloo", "tcp", True),
        ("zmq", "tcp", False),
        pytest.param("shm", "tcp", True, marks=pytest.mark.e2e),  # make test-e2e: "auto" resolves to it here
        ("auto", "tcp", True),
    ],
    ids=["zmq-tcp", "zmq-ipc", "gloo", "zmq-tcp-unstreamed", "shm", "auto"],
)
def test_two_process_handoff_is_token_exact(ray_local, tiny_llama_path, backend, transport, stream_layers):
    config = tiny_cluster_config(
        tiny_llama_path,
        transfer={"backend": backend, "zmq_transport": transport, "stream_layers": stream_layers},
        pools={"prefill": {"replicas": 1, "torch_threads": 1, "kv_blocks": 96, "max_batch_tokens": 48}},
    )
    reference = Reference(tiny_llama_path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_path)
    handle = start_serving(config)
    try:
        prompts = random_prompts(3, 20, 150, seed=31)
        prompts[0] = (prompts[0] * 10)[:150]  # several prefill chunks, streamed chunk by chunk
        for prompt in prompts:
            body = {
                "model": config.served_model_name,
                "prompt": prompt,
                "max_tokens": 12,
                "temperature": 0,
                "ignore_eos": True,
            }
            data = httpx.post(f"{handle.base_url}/v1/completions", json=body, timeout=120).json()
            expected = reference.greedy(prompt, 12)
            got = data["choices"][0]["text"]
            assert got.startswith(tokenizer.decode(expected, skip_special_tokens=True)), (got, expected)
            assert data["timing"]["kv_transfer_s"] > 0 and "kv_after_prefill_s" in data["timing"]
        status = wait_all_kv_free(handle.base_url)
        decode = next(w for w in status["workers"] if w["role"] == "decode")
        prefill = next(w for w in status["workers"] if w["role"] == "prefill")
        blocks = sum(-(-len(p) // 16) for p in prompts)
        assert decode["transfers_ok"] == prefill["transfers_ok"] == 3
        assert decode["transfer_bytes"] == blocks * BLOCK_BYTES
        assert decode["transfers_failed"] == 0 and decode["recomputes"] == 0
        if backend in ("shm", "auto"):  # one node: the prefill worker writes into the decode worker's cache
            assert set(prefill["kv_paths"].values()) == {"shm-direct"}, prefill["kv_paths"]
        # each worker's process is closed to the user's other processes: the cache went over the fd socket
        assert [record.info["dumpable"] for record in handle.pools.workers] == [False, False]
    finally:
        handle.stop()


def test_local_backend_handoff_in_process_is_token_exact(tiny_llama_path):
    """The `local` backend hands tensors over inside one process: workers as threads (no Ray)."""
    config = tiny_cluster_config(tiny_llama_path, transfer={"backend": "local"})
    reference = Reference(tiny_llama_path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_path)
    handle = start_serving(config, in_process=True)
    try:
        prompt = random_prompts(1, 90, 90, seed=41)[0]
        body = {
            "model": config.served_model_name,
            "prompt": prompt,
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
        }
        data = httpx.post(f"{handle.base_url}/v1/completions", json=body, timeout=60).json()
        expected = tokenizer.decode(reference.greedy(prompt, 12), skip_special_tokens=True)
        assert data["choices"][0]["text"].startswith(expected)
        decode = next(w for w in wait_all_kv_free(handle.base_url)["workers"] if w["role"] == "decode")
        assert decode["transfers_ok"] == 1 and decode["transfer_bytes"] == -(-90 // 16) * BLOCK_BYTES
    finally:
        handle.stop()


def _completion(handle, config, prompt: list[int], max_tokens: int = 12) -> dict:
    body = {"model": config.served_model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{handle.base_url}/v1/completions", json={**body, "ignore_eos": True}, timeout=120).json()


@pytest.mark.e2e
@pytest.mark.parametrize("arch", ["gpt_oss", "deepseek_v3"])
def test_a_family_serves_exactly_across_processes(ray_local, tmp_path_factory, arch):
    """gpt-oss (8-token sliding windows on alternate layers, attention sinks, a mixture of experts) and DeepSeek-V3
    (its latent cache, experts) over HTTP, the KV streamed between two processes over zmq: equal to transformers'
    eager greedy output."""
    from engine.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp(arch), arch=arch)
    config = tiny_cluster_config(path, transfer={"backend": "zmq"})
    reference = Reference(path, attn_implementation="eager")
    tokenizer = AutoTokenizer.from_pretrained(path)
    handle = start_serving(config)
    try:
        for prompt in random_prompts(2, 30, 90, seed=43):
            text = _completion(handle, config, prompt)["choices"][0]["text"]
            assert text.startswith(tokenizer.decode(reference.greedy(prompt, 12), skip_special_tokens=True))
        decode = next(w for w in wait_all_kv_free(handle.base_url)["workers"] if w["role"] == "decode")
        assert decode["transfers_ok"] == 2 and decode["recomputes"] == 0
    finally:
        handle.stop()


@pytest.mark.e2e
def test_an_int8_kv_cache_moves_quantized_and_decodes_as_one_engine_would(ray_local, tiny_llama_path):
    """Both pools on ``kv_cache_dtype: int8``: the wire carries the stored rows (values and scales: 20 bytes per
    head instead of 64), and the tokens equal one engine with the same cache."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.request import SamplingParams

    pools = {
        p: {"replicas": 1, "torch_threads": 1, "kv_blocks": 96, "kv_cache_dtype": "int8"} for p in ("prefill", "decode")
    }
    config = tiny_cluster_config(tiny_llama_path, pools=pools)
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_path), kv_blocks=96, kv_cache_dtype="int8"))
    prompts = random_prompts(2, 20, 90, seed=44)
    expected = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    handle = start_serving(config)
    try:
        for prompt, result in zip(prompts, expected):
            assert _completion(handle, config, prompt)["choices"][0]["text"] == result.text
        decode = next(w for w in wait_all_kv_free(handle.base_url)["workers"] if w["role"] == "decode")
        blocks = sum(-(-len(p) // 16) for p in prompts)
        assert decode["transfers_ok"] == 2 and decode["transfer_bytes"] == blocks * 16 * 2 * 3 * 2 * 20
    finally:
        handle.stop()
