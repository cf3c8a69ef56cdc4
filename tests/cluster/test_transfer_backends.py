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
        ("shm", "tcp", True),
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
