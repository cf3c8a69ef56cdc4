"""``pdserve bench kv-cache``: what a quantized KV cache (``kv_cache_dtype: int8 | fp8_e4m3``) buys and costs.

For each cache dtype, against the model's own (``auto``) in the same run: tokens per GiB of KV; greedy agreement over
chat prompts (prompts whose every token is the same, and the mean share of tokens before the first difference); the
mean and largest |Δ logprob| of the chosen token at positions where both contexts are still identical; and decode
tokens/s at one batch size, ``(t(N) - t(1)) / (batch * (N - 1))`` as ``bench engine`` measures it, interleaved.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from benchmarks.options import add_kv_cache_bench_arguments as add_arguments
from benchmarks.options import main

TOPICS = [
    "photosynthesis", "the French revolution", "black holes", "compound interest", "the water cycle",
    "machine learning", "the Roman empire", "vaccines", "plate tectonics", "jazz music", "the stock market",
    "climate change", "quantum computing", "the human heart", "volcanoes", "democracy", "electric cars",
    "the printing press", "honey bees", "the internet", "DNA", "the moon landing", "coffee", "chess",
    "the Great Wall of China", "rainbows", "antibiotics", "the Olympic games", "solar panels", "sleep",
    "the Renaissance", "earthquakes", "recycling", "the violin", "glaciers", "cryptography", "tea ceremonies",
    "the Silk Road", "penguins", "nuclear fusion", "origami", "the immune system", "deserts", "bread baking",
    "lighthouses", "the periodic table", "hurricanes", "submarines", "mountain climbing", "the metric system",
]  # fmt: skip


def _generate(engine, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs, per prompt."""
    from engine.request import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    ids = [engine.add_request(prompt, params.copy()) for prompt in prompts]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    logprobs: dict[str, list[float]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += [lp.logprob for lp in out.logprobs or []]
    return [(tokens[rid], logprobs[rid]) for rid in ids]


def _agreement(base: list[tuple[list[int], list[float]]], other: list[tuple[list[int], list[float]]]) -> dict:
    same_prompts, shares, gaps = 0, [], []
    for (base_tokens, base_lps), (tokens, lps) in zip(base, other):
        agree = next((i for i, (a, b) in enumerate(zip(base_tokens, tokens)) if a != b), len(base_tokens))
        same_prompts += agree == len(base_tokens)
        shares.append(agree / len(base_tokens))
        # through the first differing token itself: its context was still identical
        gaps += [abs(a - b) for a, b in zip(base_lps[: agree + 1], lps[: agree + 1])]
    return {
        "prompts_identical": f"{same_prompts}/{len(base)}",
        "tokens_before_first_difference": round(statistics.mean(shares), 4),
        "mean_abs_logprob_gap": round(statistics.mean(gaps), 5),
        "max_abs_logprob_gap": round(max(gaps), 4),
    }


def _decode_tokens_per_s(engines: dict, prompts: list[list[int]], max_tokens: int, repeats: int) -> dict[str, float]:
    from bench.engine_bench import decode_rates, interleaved_medians
    from engine.request import SamplingParams

    def generate(engine, new_tokens: int) -> None:
        engine.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))

    runs = {}
    for name, engine in engines.items():  # in turns, so a noisy neighbour slows every dtype alike
        runs[f"{name}_full"] = lambda engine=engine: generate(engine, max_tokens)
        runs[f"{name}_first"] = lambda engine=engine: generate(engine, 1)
    return decode_rates(interleaved_medians(runs, repeats), list(engines), len(prompts) * (max_tokens - 1))


def run(args: argparse.Namespace) -> dict:
    import torch

    from engine.config import EngineConfig
    from engine.kv_cache import QUANT_MAX
    from engine.llm_engine import LLMEngine

    dtypes = [d for d in args.dtypes.split(",") if d]
    unknown = [d for d in dtypes if d not in QUANT_MAX]
    if unknown:
        raise ValueError(f"--dtypes: {unknown} are not quantized cache dtypes ({', '.join(QUANT_MAX)})")
    for flag in ("prompts", "max_tokens", "batch", "repeats"):
        if getattr(args, flag) < 1 or (flag == "max_tokens" and args.max_tokens < 2):
            raise ValueError(f"--{flag.replace('_', '-')} must be a positive integer (max-tokens at least 2)")
    engines = {
        name: LLMEngine(
            EngineConfig(
                model=args.model,
                dtype="float32",
                kv_cache_dtype=name,
                kv_cache_memory_bytes=1 << 28,
                max_num_seqs=max(args.prompts, args.batch),
                enable_prefix_caching=False,
            )
        )
        for name in ["auto", *dtypes]
    }
    base = engines["auto"]
    questions = [f"Explain {TOPICS[i % len(TOPICS)]} in a few sentences." for i in range(args.prompts)]
    prompts = [
        base.tokenize(
            base.tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
            )
        )
        for q in questions
    ]
    outputs = {name: _generate(engine, prompts, args.max_tokens) for name, engine in engines.items()}
    speed = _decode_tokens_per_s(engines, prompts[: args.batch], args.max_tokens, args.repeats)
    caches: dict[str, dict] = {}
    for name, engine in engines.items():
        spec = engine.kv_spec
        row = {
            "kv_bytes_per_token": spec.bytes_per_token,
            "tokens_per_gib": (1 << 30) // spec.bytes_per_token,
            "decode_tokens_per_s": speed[name],
        }
        if name != "auto":
            row["tokens_per_gib_vs_auto"] = round(engines["auto"].kv_spec.bytes_per_token / spec.bytes_per_token, 2)
            row["decode_speed_vs_auto"] = round(speed[name] / speed["auto"], 3)
            row |= _agreement(outputs["auto"], outputs[name])
        engine.check_no_leaks()
        caches[name] = row
    return {
        "model": args.model,
        "model_dtype": "float32",
        "torch_threads": torch.get_num_threads(),
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "decode_batch": args.batch,
        "kv_cache_dtype": caches,
    }


if __name__ == "__main__":
    sys.exit(main("python -m benchmarks.kv_quant_bench", add_arguments, run))
