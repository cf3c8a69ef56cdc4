"""``pdserve demo``: the default model answering a few chat prompts, with its speed.

At this stage of the project the demo drives the engine directly (one process, batched); the cluster demo (router,
prefill and decode pools) replaces it once the cluster exists.
"""

from __future__ import annotations

import argparse
import time

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_loader import DEFAULT_MODEL
from engine.request import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for staying focused.",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one sentence.",
]


def run_demo(args: argparse.Namespace) -> int:
    model = args.model or DEFAULT_MODEL
    print(f"loading {model} ...", flush=True)
    started = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=model))
    print(f"loaded in {time.perf_counter() - started:.1f} s; KV cache: {engine.block_manager.num_blocks} blocks "
          f"of {engine.config.block_size} tokens, {engine.kv_spec.bytes_per_token} bytes/token\n")
    prompts = [
        engine.tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in QUESTIONS
    ]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    started = time.perf_counter()
    results = engine.generate([engine.tokenize(p) for p in prompts], params)
    elapsed = time.perf_counter() - started
    for question, result in zip(QUESTIONS, results):
        print(f"> {question}\n{result.text.strip()}\n  [{len(result.token_ids)} tokens, finish: {result.finish_reason}]\n")
    generated = sum(len(r.token_ids) for r in results)
    prompt_tokens = sum(r.num_prompt_tokens for r in results)
    print(f"{len(results)} requests batched: {prompt_tokens} prompt + {generated} generated tokens in {elapsed:.2f} s "
          f"= {generated / elapsed:.1f} generated tokens/s")
    engine.check_no_leaks()
    return 0
