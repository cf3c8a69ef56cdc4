"""``pdserve bench engine``: decode and prefill throughput of the engine against transformers ``generate``, and at
batch 1 against llama.cpp on the same F32 weights when llama-cpp-python is installed (bench/llama_cpp_baseline.py).

Both sides run the same prompts (equal lengths: ``generate`` needs no padding) on the same weights. Decode tokens/s
is ``(t(N tokens) - t(1 token)) / (batch * (N - 1))`` for both, so prefill and start-up are subtracted, not guessed.
Each figure is the median of ``--repeats`` runs after a warm-up, reported as a ratio against transformers in the
same run because this machine is shared; the CPU is named beside them. The compiled decode step (the CPU serving
configs' default) is measured from a cold start (compiled into an empty entry on disk) and a warm one (another
process loading that entry), both printed under ``compiled_decode``. ``interleaved_medians`` and ``decode_rates`` are the timing rules the
experiments that measure the engine (benchmarks/speculative_bench.py, kv_quant_bench.py, model_families_bench.py)
take from here. ``--speculative ngram`` runs the speculative experiment instead (cli/main.py's ``ROUTES``: it is
benchmarks/speculative_bench.py, ``pdserve bench speculative``), never this module's ``run``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import subprocess
import sys
import time

import torch

from bench.llama_cpp_baseline import LlamaCpp, gguf_type, unavailable_reason
from bench.options import add_engine_bench_arguments as add_arguments  # noqa: F401 (re-exported, light)
from bench.options import engine_bench_defaults
from engine.compile_cache import CompiledStore
from engine.config import EngineConfig
from engine.cpu_info import cpu_model
from engine.llm_engine import LLMEngine
from engine.model_loader import parse_dtype, resolve_model_path
from engine.request import SamplingParams


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - started


def interleaved_medians(fns: dict[str, object], repeats: int) -> dict[str, float]:
    """Median time of each function, run in turns so that noise from a shared machine hits all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(_timed(fn))
    return {name: statistics.median(values) for name, values in times.items()}


def decode_rates(times: dict[str, float], names: list[str], tokens: int) -> dict[str, float]:
    """Decode tokens/s of each name from its ``{name}_full`` and ``{name}_first`` times: prefill and start-up cancel."""
    return {name: round(tokens / max(times[f"{name}_full"] - times[f"{name}_first"], 1e-9), 1) for name in names}


WARM_START = """
import json, sys, time
from engine.config import EngineConfig
from engine.engine_parts import build_engine_parts
started = time.perf_counter()
graphs = build_engine_parts(EngineConfig(**json.loads(sys.argv[1]))).runner.decode_graphs
print(json.dumps({"engine_s": time.perf_counter() - started, "step_s": sum(graphs.compile_s.values()),
                  "loaded": sorted(graphs.loaded), "buckets": graphs.batch_buckets}))
"""


def _compiled_engine(config: EngineConfig) -> tuple[LLMEngine, dict[str, object]]:
    """The engine with its decode step compiled from a cold start (an entry on disk that held it is removed
    first), and the seconds a warm start of another process takes to load it: the whole engine and the step."""
    engine = LLMEngine(config)
    graphs = engine.runner.decode_graphs
    assert graphs is not None
    if graphs.loaded:  # kept by an earlier run: compiled again, for the cold figure
        store = CompiledStore(graphs.cache_fields())
        with store.locked():
            store.clear()
        engine = LLMEngine(config)
        graphs = engine.runner.decode_graphs
        assert graphs is not None and not graphs.loaded
    times: dict[str, object] = {"cold_start_step_s": round(sum(graphs.compile_s.values()), 1)}
    settings = json.dumps(dataclasses.asdict(engine.config))
    done = subprocess.run(
        [sys.executable, "-c", WARM_START, settings], capture_output=True, text=True, timeout=600, check=False
    )
    try:
        warm = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return engine, times | {"warm_start": f"failed: {done.stderr[-500:]}"}
    times["warm_start_step_s"] = round(warm["step_s"], 1)
    times["warm_start_engine_s"] = round(warm["engine_s"], 1)
    times["warm_start_loaded_all"] = warm["loaded"] == warm["buckets"]
    return engine, times


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM

    engine_bench_defaults(args)  # --batch-sizes 1,8,32, --output-len 32 unless given
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_batch_tokens=max(4096, args.prefill_prompts * args.prefill_len),
        max_num_seqs=256,
        kv_cache_memory_bytes=1 << 30,
        enable_prefix_caching=False,  # repeated prompts must be recomputed, not served from cache
        attention_backend=getattr(args, "attention_backend", "auto"),
    )
    engine = LLMEngine(config)
    # on a CPU, the same engine on torch's linear everywhere (engine/cpu_linear.py): what the tuned products gain
    plain = LLMEngine(dataclasses.replace(config, cpu_linear_tuning=False)) if args.device == "cpu" else None
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    # and with its decode step compiled for each measured batch size (engine/decode_graphs.py, StaticStep.COMPILED)
    compiled = None
    start_times: dict[str, object] = {}
    if args.device == "cpu" and not getattr(args, "no_compiled", False):
        compiled_config = dataclasses.replace(
            config, compile_decode_batches=sorted(set(sizes)), compile_decode_background=False
        )
        compiled, start_times = _compiled_engine(compiled_config)
    hf = (
        AutoModelForCausalLM.from_pretrained(
            resolve_model_path(args.model), dtype=parse_dtype(args.dtype), attn_implementation="sdpa"
        )
        .to(args.device)
        .eval()
    )
    vocab = min(engine.model.config.vocab_size, len(engine.tokenizer))
    rng = random.Random(0)
    specials = set(engine.tokenizer.all_special_ids)
    ordinary = [t for t in range(vocab) if t not in specials]

    def prompts(count: int, length: int) -> list[list[int]]:
        return [[rng.choice(ordinary) for _ in range(length)] for _ in range(count)]

    def ours(batch: list[list[int]], new_tokens: int, which: LLMEngine = engine) -> None:
        results = which.generate(batch, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
        assert all(len(r.token_ids) == new_tokens for r in results)

    @torch.inference_mode()
    def theirs(batch: list[list[int]], new_tokens: int) -> None:
        input_ids = torch.tensor(batch, device=args.device)
        out = hf.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=hf.config.pad_token_id or 0,
        )
        assert out.shape[1] == input_ids.shape[1] + new_tokens

    warm = prompts(2, 16)
    ours(warm, 4)
    for other in (plain, compiled):
        if other is not None:
            ours(warm, 4, other)
    theirs(warm, 4)
    llama_cpp_missing = unavailable_reason(args.model, args.dtype)
    llama = None
    if llama_cpp_missing is None:
        llama = LlamaCpp(torch.get_num_threads(), args.input_len + args.output_len + 8, args.dtype)

    decode: dict[str, dict] = {}
    for batch_size in sizes:
        batch = prompts(batch_size, args.input_len)
        tokens = batch_size * (args.output_len - 1)
        fns = {
            "pdserve_full": lambda batch=batch: ours(batch, args.output_len),  # bound: run in this iteration
            "transformers_full": lambda batch=batch: theirs(batch, args.output_len),
            "pdserve_first": lambda batch=batch: ours(batch, 1),
            "transformers_first": lambda batch=batch: theirs(batch, 1),
        }
        names = ["pdserve", "transformers"]
        if plain is not None:
            fns["pdserve_linear_full"] = lambda batch=batch: ours(batch, args.output_len, plain)
            fns["pdserve_linear_first"] = lambda batch=batch: ours(batch, 1, plain)
            names.append("pdserve_linear")
        if compiled is not None:
            fns["pdserve_compiled_full"] = lambda batch=batch: ours(batch, args.output_len, compiled)
            fns["pdserve_compiled_first"] = lambda batch=batch: ours(batch, 1, compiled)
            names.append("pdserve_compiled")
        with_llama = llama is not None and batch_size == 1
        if with_llama:
            assert llama is not None
            fns["llama_cpp_full"] = lambda llama=llama, batch=batch: llama.greedy(batch[0], args.output_len)
            fns["llama_cpp_first"] = lambda llama=llama, batch=batch: llama.greedy(batch[0], 1)
            names.append("llama_cpp")
        t = interleaved_medians(fns, args.repeats)
        figures = {f"{name}_decode_tokens_per_s": rate for name, rate in decode_rates(t, names, tokens).items()}
        figures["ratio_vs_transformers"] = round(
            figures["pdserve_decode_tokens_per_s"] / figures["transformers_decode_tokens_per_s"], 3
        )
        if plain is not None:
            figures["ratio_vs_torch_linear"] = round(
                figures["pdserve_decode_tokens_per_s"] / figures["pdserve_linear_decode_tokens_per_s"], 3
            )
        if compiled is not None:
            rate = figures["pdserve_compiled_decode_tokens_per_s"]
            others = {"eager": "pdserve", "transformers": "transformers"} | (
                {"llama_cpp": "llama_cpp"} if with_llama else {}
            )
            for label, name in others.items():
                figures[f"compiled_ratio_vs_{label}"] = round(rate / figures[f"{name}_decode_tokens_per_s"], 3)
            params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
            figures["compiled_answers_equal"] = [r.token_ids for r in compiled.generate(batch, params)] == [
                r.token_ids for r in engine.generate(batch, params)
            ]
        if with_llama:
            assert llama is not None
            figures["ratio_vs_llama_cpp"] = round(
                figures["pdserve_decode_tokens_per_s"] / figures["llama_cpp_decode_tokens_per_s"], 3
            )
            params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
            figures["llama_cpp_answer_equal"] = engine.generate(batch, params)[0].token_ids == llama.greedy(
                batch[0], args.output_len
            )
        decode[str(batch_size)] = figures
    keys = list(decode)
    if len(keys) > 1:
        decode[keys[-1]][f"ratio_vs_pdserve_batch_{keys[0]}"] = round(
            decode[keys[-1]]["pdserve_decode_tokens_per_s"] / decode[keys[0]]["pdserve_decode_tokens_per_s"], 2
        )

    prefill_batch = prompts(args.prefill_prompts, args.prefill_len)
    prefill_tokens = args.prefill_prompts * args.prefill_len

    @torch.inference_mode()
    def hf_forward() -> None:
        hf(torch.tensor(prefill_batch, device=args.device), use_cache=False, logits_to_keep=1)

    t = interleaved_medians({"pdserve": lambda: ours(prefill_batch, 1), "transformers": hf_forward}, args.repeats)
    ours_prefill, hf_prefill = t["pdserve"], t["transformers"]
    engine.check_no_leaks()
    for other in (plain, compiled):
        if other is not None:
            other.check_no_leaks()
    compiled_graphs = compiled.runner.decode_graphs if compiled is not None else None
    return {
        "cpu": cpu_model() if args.device == "cpu" else None,
        "model": args.model,
        "dtype": args.dtype,
        "device": args.device,
        "attention_backend": engine.runner.backend.name,
        "torch_threads": torch.get_num_threads(),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "decode": decode,
        "llama_cpp": f"{gguf_type(args.dtype)} GGUF of the served weights, batch 1"
        if llama is not None
        else llama_cpp_missing,
        # the compiled step: seconds each batch size's compile took at start-up, and steps that ran eagerly instead
        "compiled_decode": None
        if compiled_graphs is None
        else {
            **start_times,
            "compile_s": {str(b): s for b, s in compiled_graphs.compile_s.items()},
            "eager_steps": {reason.name: n for reason, n in compiled_graphs.fallbacks.items()},
        },
        "prefill": {
            "prompts": args.prefill_prompts,
            "prompt_len": args.prefill_len,
            "pdserve_tokens_per_s": round(prefill_tokens / ours_prefill, 1),
            "transformers_forward_tokens_per_s": round(prefill_tokens / hf_prefill, 1),
        },
        "kv_bytes_per_token": engine.kv_spec.bytes_per_token,
    }
