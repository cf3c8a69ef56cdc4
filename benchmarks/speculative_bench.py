"""``pdserve bench speculative``: decode speed with n-gram speculation against three baselines.

Per prompt set (``grounded``: answers that copy from the prompt, benchmarks/speculative_prompts.py; ``random``: random
token prompts; ``random_sampled``: the same, sampled at temperature 1 with a seed per prompt, where proposals are
mostly refused) and batch size (1: ``--batch1-prompts`` prompts one after another), four ways to make the same
answers, timed in turns:
- ``pdserve_speculative``: one engine with ``speculative`` set; ``pdserve``: the same engine, every request opted out;
- ``transformers_prompt_lookup``: ``generate(prompt_lookup_num_tokens=k, max_matching_ngram_size=ngram_max)``, the
  same algorithm; transformers runs it for one sequence at a time, so a batch is its prompts one after another;
- ``transformers``: plain ``generate``, the batch left-padded.
Answers end at EOS or ``--output-len``. Decode tokens/s is ``(tokens - prompts) / (t(answers) - t(first tokens))`` for
each, so prefill cancels. Ratios are against ``pdserve`` in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys

import torch

from bench.engine_bench import interleaved_medians
from benchmarks.options import add_speculative_bench_arguments as add_arguments
from benchmarks.options import main
from benchmarks.speculative_prompts import chat_prompts
from engine.config import EngineConfig, SpeculativeConfig
from engine.llm_engine import LLMEngine
from engine.model_loader import parse_dtype, resolve_model_path
from engine.request import SamplingParams

METHODS = ("pdserve_speculative", "pdserve", "transformers_prompt_lookup", "transformers")


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    spec = SpeculativeConfig(method=args.speculative, num_tokens=args.num_spec_tokens, ngram_max=args.ngram_max)
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            device=device,
            max_num_seqs=64,
            kv_cache_memory_bytes=1 << 30,
            enable_prefix_caching=False,  # every run computes its prompts again
            speculative=spec,
            compile_decode_batches=[int(b) for b in args.compile_batches.split(",")] if args.compile_batches else None,
        )
    )
    speculator = engine.speculator
    assert speculator is not None  # speculative is set and the engine decodes
    engine.warm_up()  # also times decode steps by rows: which proposals are worth verifying
    assert speculator.step_times is not None
    hf = (
        AutoModelForCausalLM.from_pretrained(
            resolve_model_path(args.model), dtype=parse_dtype(args.dtype), attn_implementation="sdpa"
        )
        .to(device)
        .eval()
    )
    eos = sorted(engine.eos_token_ids)
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else eos[0]
    rng = random.Random(0)
    specials = set(engine.tokenizer.all_special_ids)
    ordinary = [t for t in range(min(engine.vocab_size, len(engine.tokenizer))) if t not in specials]
    batch_sizes = [int(b) for b in (args.batch_sizes or "1,8").split(",")]
    count = max(*batch_sizes, args.batch1_prompts)
    random_prompts = [[rng.choice(ordinary) for _ in range(args.input_len)] for _ in range(count)]
    # (prompts, sampled): greedy answers on both sets; on random prompts also seeded samples at temperature 1,
    # where proposals are mostly refused (what speculation costs when it does not pay)
    sets = {
        "grounded": (chat_prompts(engine.tokenizer, count), False),
        "random": (random_prompts, False),
        "random_sampled": (random_prompts, True),
    }

    def ours(prompts: list[list[int]], new_tokens: int, speculative: bool, alone: bool, sampled: bool):
        params = [
            SamplingParams(max_tokens=new_tokens, temperature=1.0 if sampled else 0.0, seed=i, speculative=speculative)
            for i in range(len(prompts))
        ]
        if alone:  # batch 1: each prompt in turn
            return [engine.generate([p], [sp])[0].token_ids for p, sp in zip(prompts, params)]
        return [r.token_ids for r in engine.generate(prompts, params)]

    @torch.inference_mode()
    def theirs(prompts: list[list[int]], new_tokens: int, lookup: bool, alone: bool, sampled: bool):
        if lookup or alone:
            return [_generate(hf, [p], new_tokens, pad, eos, device, lookup, sampled, args)[0] for p in prompts]
        return _generate(hf, prompts, new_tokens, pad, eos, device, False, sampled, args)

    out: dict = {
        "model": args.model,
        "device": device,
        "torch_threads": torch.get_num_threads(),
        "speculative": {"method": spec.method, "num_tokens": spec.num_tokens, "ngram_max": spec.ngram_max},
        "output_len": args.output_len,
        # the compiled decode step's sizes and their compile seconds (None: eager)
        "compiled_decode": None
        if engine.runner.decode_graphs is None
        else {str(b): s for b, s in engine.runner.decode_graphs.compile_s.items()},
        "step_ms_by_rows": {
            rows: round(seconds * 1000, 1)
            for rows, seconds in zip(speculator.step_times.rows, speculator.step_times.seconds)
        },
    }
    chosen = args.prompt_sets.split(",")
    if unknown := set(chosen) - set(sets):
        raise ValueError(f"--prompt-sets: {sorted(unknown)} are not among {sorted(sets)}")
    for set_name in chosen:
        all_prompts, sampled = sets[set_name]
        for batch_size in batch_sizes:
            prompts = all_prompts[: args.batch1_prompts if batch_size == 1 else batch_size]
            before = dataclasses.replace(speculator.totals)
            answers: dict[str, list[list[int]]] = {}

            fns = {
                f"{name}_{part}": _timed_call(
                    ours, theirs, prompts, name, new_tokens, answers, batch_size == 1, sampled
                )
                for name in METHODS
                for part, new_tokens in (("full", args.output_len), ("first", 1))
            }
            ours(prompts, 4, True, False, sampled)  # warm-up
            times = interleaved_medians(fns, args.repeats)
            figures: dict = {}
            for name in METHODS:
                tokens = sum(len(a) for a in answers[name]) - len(prompts)
                figures[f"{name}_decode_tokens_per_s"] = round(
                    tokens / max(times[f"{name}_full"] - times[f"{name}_first"], 1e-9), 1
                )
            base = figures["pdserve_decode_tokens_per_s"]
            for name in METHODS:
                if name != "pdserve":
                    figures[f"{name}_vs_pdserve"] = round(figures[f"{name}_decode_tokens_per_s"] / base, 3)
            figures["speculative_vs_transformers_prompt_lookup"] = round(
                figures["pdserve_speculative_decode_tokens_per_s"]
                / figures["transformers_prompt_lookup_decode_tokens_per_s"],
                3,
            )
            counted = speculator.totals.since(before)
            proposed = counted.proposed_tokens
            figures["proposed_tokens"] = proposed
            figures["acceptance_rate"] = round(counted.accepted_tokens / proposed, 3) if proposed else 0.0
            figures["mean_accepted_length"] = round(counted.mean_accepted_length, 2)
            reference = answers["pdserve"]
            figures["answer_tokens"] = sum(len(a) for a in reference)
            # greedy, or seeded: speculation never changes an answer
            figures["speculative_answers_identical"] = answers["pdserve_speculative"] == reference
            if not sampled:
                figures["transformers_answers_equal_fraction"] = sum(
                    a == b for a, b in zip(answers["transformers_prompt_lookup"], reference)
                ) / len(reference)
            out.setdefault(set_name, {})[str(batch_size)] = figures
    engine.check_no_leaks()
    return out


def _timed_call(ours, theirs, prompts, name: str, new_tokens: int, answers: dict, alone: bool, sampled: bool):
    """One method's run over the prompts (``alone``: one at a time); a full run's answers go to ``answers[name]``."""

    def call() -> None:
        if name.startswith("pdserve"):
            result = ours(prompts, new_tokens, name == "pdserve_speculative", alone, sampled)
        else:
            result = theirs(prompts, new_tokens, name == "transformers_prompt_lookup", alone, sampled)
        if new_tokens > 1:
            answers[name] = result

    return call


def _generate(hf, prompts, new_tokens, pad, eos, device, lookup, sampled, args) -> list[list[int]]:
    """transformers' answers (left-padded batch; greedy, or sampled at temperature 1), cut at the first EOS as ours
    are."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    extra = {"prompt_lookup_num_tokens": args.num_spec_tokens, "max_matching_ngram_size": args.ngram_max}
    out = hf.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        do_sample=sampled,
        temperature=1.0 if sampled else None,
        top_p=None,
        top_k=None,
        pad_token_id=pad,
        eos_token_id=eos,
        **(extra if lookup else {}),
    )
    answers = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        answers.append(row[:cut])
    return answers


if __name__ == "__main__":
    sys.exit(main("python -m benchmarks.speculative_bench", add_arguments, run))
