"""``pdserve bench models``: every model family the engine serves, token-exact against transformers, and its pace.

For each tiny family (``engine.tiny_model.TINY_ARCHITECTURES``, or ``--families``) and each other transformers
``model_type`` (``--model-types``, built with the same small sizes), a random-weight model is written to a temporary
folder and loaded by the engine. A row then holds what the engine's probe found (features, KV bytes per token in
float32), how many of ``--prompts`` random prompts give the same greedy tokens as transformers' eager ``generate``
(the reference stops at EOS, the engine ignores it: compared up to the reference's length), and CPU decode tokens/s
of the engine and of ``generate`` on one batch of equal-length prompts, measured as ``pdserve bench engine`` does
(``t(N tokens) - t(1 token)``, interleaved, median of ``--repeats``). A model the engine refuses at load is a row with
the refusal; one that fails in any other way is a row with its error, and the run goes on.

    pdserve bench models --model-types olmo2,mamba   # {"families": [...], "summary": {"exact": 12, "refused": 1, ...}, ...}
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import tempfile
from collections.abc import Callable, Collection
from functools import partial
from pathlib import Path
from typing import Any

import torch

from bench.engine_bench import decode_rates, interleaved_medians
from benchmarks.options import add_model_families_bench_arguments as add_arguments
from benchmarks.options import main
from engine.config import EngineConfig, check_parallel, worker_ranks
from engine.llm_engine import LLMEngine
from engine.request import SamplingParams
from engine.tiny_model import TINY_ARCHITECTURES, build_byte_tokenizer, build_tiny_model, tiny_fields

logger = logging.getLogger(__name__)

BLOCK_SIZE = 16  # EngineConfig's default
MESSAGE_CHARS = 300
EXACT_PROMPT_LENS = (12, 64)  # past the tiny models' 8-token sliding windows


def _names(value: str | None, flag: str, known: Collection[str], listed: bool = True) -> list[str]:
    names = [name.strip() for name in (value or "").split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    if unknown:
        choices = f"; one of {', '.join(known)}" if listed else ""
        raise ValueError(f"{flag}: unknown {', '.join(map(repr, unknown))}{choices}")
    return names


def _short(exc: BaseException) -> str:
    """An exception as a table cell: transformers' messages can list every model type it knows."""
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= MESSAGE_CHARS else text[: MESSAGE_CHARS - 1] + "…"


def _check_positive(args: argparse.Namespace) -> None:
    for name in ("prompts", "max_tokens", "batch", "input_len", "repeats", "torch_threads"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if args.max_tokens < 2:
        raise ValueError(f"--max-tokens must be at least 2 (decode pace is t(N) - t(1)), got {args.max_tokens}")
    try:
        check_parallel(args.tensor_parallel_size, args.expert_parallel_size)
    except ValueError as exc:
        raise ValueError(f"--{str(exc).replace('_', '-')}") from None


def _build_family(out: Path, arch: str) -> None:
    build_tiny_model(out, arch=arch)


def build_other_model(out: Path, model_type: str, seed: int = 0) -> str | None:
    """A tiny random-weight model of any transformers ``model_type``, with build_tiny_model's sizes and tokenizer.
    When transformers cannot build the weights, the folder holds the config alone (the engine's config check still
    runs) and the error is returned."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = build_byte_tokenizer()
    config = AutoConfig.for_model(model_type, **tiny_fields(tokenizer), head_dim=16)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    try:
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(config).eval().save_pretrained(out)
    except Exception as exc:  # noqa: BLE001 - reported in the row; the engine still judges the config
        config.save_pretrained(out)
        return _short(exc)
    return None


class _Measured:
    """One loaded model: the engine, transformers' eager reference, and transformers' fastest attention for speed."""

    def __init__(self, path: Path, engine: LLMEngine) -> None:
        from transformers import AutoModelForCausalLM

        self.engine = engine
        self.reference = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        try:
            self.baseline = AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, attn_implementation="sdpa"
            ).eval()
            self.baseline_attention = "sdpa"
        except ValueError:  # the family has no sdpa path in transformers
            self.baseline, self.baseline_attention = self.reference, "eager"
        vocab = min(int(engine.model.config.vocab_size), len(engine.tokenizer))
        specials = set(engine.tokenizer.all_special_ids)
        self.ordinary = [t for t in range(vocab) if t not in specials]

    def prompts(self, count: int, lengths: tuple[int, int], seed: int) -> list[list[int]]:
        rng = random.Random(seed)
        return [[rng.choice(self.ordinary) for _ in range(rng.randint(*lengths))] for _ in range(count)]

    @torch.inference_mode()
    def hf_generate(self, model: Any, batch: list[list[int]], new_tokens: int, force_length: bool) -> torch.Tensor:
        input_ids = torch.tensor(batch)
        length = {"min_new_tokens": new_tokens} if force_length else {}  # else stop at EOS, as the reference does
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=model.config.pad_token_id or 0,
            **length,
        )
        return out[:, input_ids.shape[1] :]

    def engine_generate(self, batch: list[list[int]], new_tokens: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        return [list(result.token_ids) for result in self.engine.generate(batch, params)]

    def exact(self, count: int, new_tokens: int) -> tuple[int, int]:
        """Prompts (of ``count``) whose engine tokens equal the eager reference's, one prompt at a time."""
        prompts = self.prompts(count, EXACT_PROMPT_LENS, seed=0)
        ours = self.engine_generate(prompts, new_tokens)
        matched = 0
        for prompt, tokens in zip(prompts, ours):
            expected = self.hf_generate(self.reference, [prompt], new_tokens, force_length=False)[0].tolist()
            matched += tokens[: len(expected)] == expected
        return matched, count

    def decode_speed(self, batch_size: int, input_len: int, new_tokens: int, repeats: int) -> dict[str, Any]:
        batch = self.prompts(batch_size, (input_len, input_len), seed=1)

        def ours(n: int) -> None:
            assert all(len(tokens) == n for tokens in self.engine_generate(batch, n))

        def theirs(n: int) -> None:
            assert self.hf_generate(self.baseline, batch, n, force_length=True).shape[1] == n

        ours(new_tokens)  # warm-up, at full length: a tiny model's step is short enough for first calls to show
        theirs(new_tokens)
        t = interleaved_medians(
            {
                "pdserve_full": lambda: ours(new_tokens),
                "transformers_full": lambda: theirs(new_tokens),
                "pdserve_first": lambda: ours(1),
                "transformers_first": lambda: theirs(1),
            },
            repeats,
        )
        rates = decode_rates(t, ["pdserve", "transformers"], batch_size * (new_tokens - 1))
        return {
            "pdserve_decode_tokens_per_s": rates["pdserve"],
            "transformers_decode_tokens_per_s": rates["transformers"],
            "ratio_vs_transformers": round(rates["pdserve"] / rates["transformers"], 3),
            "transformers_attention": self.baseline_attention,
        }


def _kv_blocks(args: argparse.Namespace) -> int:
    """Room for the larger of the two parts' batches, every sequence's last block partly filled."""
    speed = args.batch * (args.input_len + args.max_tokens)
    exact = args.prompts * (EXACT_PROMPT_LENS[1] + args.max_tokens)
    return max(speed, exact) // BLOCK_SIZE + max(args.batch, args.prompts) + 1


def measure(name: str, model_type: str, build: Callable[[Path], str | None], args: argparse.Namespace) -> dict:
    """One row: built, loaded (or refused), compared and timed; any other failure is the row's ``error``."""
    row: dict[str, Any] = {"name": name, "model_type": model_type}
    stage = "build"
    try:
        with tempfile.TemporaryDirectory(prefix=f"pdserve-models-{name}-") as tmp:
            path = Path(tmp)
            build_error = build(path)
            if build_error:
                row["build_error"] = build_error
            stage = "load"
            try:
                engine = LLMEngine(
                    EngineConfig(
                        model=str(path),
                        dtype="float32",
                        kv_blocks=_kv_blocks(args),
                        max_batch_tokens=max(2048, args.batch * args.input_len),
                        max_num_seqs=max(64, args.batch),
                        enable_prefix_caching=False,  # repeated prompts are recomputed, not served from cache
                    )
                )
            except ValueError as exc:
                if not str(exc).startswith("model:"):
                    raise
                row["refused"] = str(exc)
                return row
            row["features"] = engine.attention.features
            row["kv_bytes_per_token"] = engine.kv_spec.bytes_per_token
            stage = "measure"
            measured = _Measured(path, engine)
            matched, count = measured.exact(args.prompts, args.max_tokens)
            row["exact"] = f"{matched}/{count}"
            row["all_exact"] = matched == count
            row |= measured.decode_speed(args.batch, args.input_len, args.max_tokens, args.repeats)
            engine.check_no_leaks()
            if worker_ranks(args.tensor_parallel_size, args.expert_parallel_size) > 1:
                stage = "tensor parallel"
                prompts = measured.prompts(args.prompts, (12, 64), seed=2)
                del measured, engine
                row["tensor_parallel"] = tensor_parallel_row(str(path), prompts, args)
    except Exception as exc:  # noqa: BLE001 - one family's failure is its row, not the end of the run
        logger.debug("%s failed", name, exc_info=True)
        row["error"] = f"{stage}: {_short(exc)}"
    return row


def tensor_parallel_row(model: str, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    """The family at ``--tensor-parallel-size`` N (its experts split ``--expert-parallel-size`` E ways) against one
    rank (``benchmarks/tp_bench.py``'s rank, each in a process, the same total threads): same greedy tokens, the
    largest gap between chosen tokens' logprobs, step times; or why it is refused. A mixture whose plan refuses
    tensor degree N is measured with its experts split alone (tensor 1, expert E), the refusal beside."""
    from transformers import AutoConfig

    from benchmarks.tp_bench import _rank
    from engine.blocks import routed_experts
    from engine.tp_launch import run_ranks
    from engine.tp_shard import check_degree

    tensor = args.tensor_parallel_size
    config = AutoConfig.from_pretrained(model)
    experts = args.expert_parallel_size if routed_experts(config.to_dict()) else 1  # a dense family: as the plan says
    tensor_refused: dict[str, str] = {}
    try:
        check_degree(config, tensor, experts)
    except ValueError as exc:
        if experts == 1 or tensor == 1:
            return {"degree": tensor, "refused": str(exc)}
        tensor, tensor_refused = 1, {"tensor_refused": str(exc)}
        try:
            check_degree(config, tensor, experts)
        except ValueError as alone:
            return {"degree": args.tensor_parallel_size, "refused": f"{exc}; experts alone: {alone}"}
    size = worker_ranks(tensor, experts)
    if size == 1:
        return {"degree": tensor, "refused": "a dense model at tensor degree 1: nothing to split"}
    payload = {
        "model": model,
        "threads": max(size, args.torch_threads),
        "batch": len(prompts),
        "input_len": max(len(p) for p in prompts),
        "output_len": args.max_tokens,
        "repeats": args.repeats,
        "prompts": prompts,
        "logprobs": True,
    }
    one = run_ranks(_rank, 1, payload, timeout_s=600)[0]
    layout = {"tensor_parallel_size": tensor, "expert_parallel_size": experts}
    many = run_ranks(_rank, size, payload | layout, timeout_s=600)[0]
    gap = max(
        (
            abs(a - b)
            for x, y in zip(one["logprobs"], many["logprobs"], strict=True)
            for a, b in zip(x, y, strict=False)
        ),
        default=0.0,
    )
    # each of a rank's row-parallel linears (o, a dense MLP's down) ends in an all-reduce of the hidden state (ring:
    # 2 (N - 1) / N of it leaves each rank): derived from the shape, float32
    ring_bytes = many["row_parallel_linears"] * config.hidden_size * 4 * 2 * (size - 1) / size
    return {
        "degree": tensor,
        "expert_degree": experts,
        "ranks": size,
        **tensor_refused,
        "exact": one["tokens"] == many["tokens"],
        "all_reduce_bytes_per_token_per_rank": round(ring_bytes),
        **({"experts": many["expert_traffic"]} if many.get("expert_traffic") else {}),
        "logprob_gap": float(f"{gap:.3g}"),
        "decode_step_ms": {"1": round(one["decode_step_ms"], 2), str(size): round(many["decode_step_ms"], 2)},
        "decode_step_ratio": round(many["decode_step_ms"] / one["decode_step_ms"], 2),
    }


def status(row: dict) -> str:
    if "error" in row:
        return "failed"
    if "refused" in row:
        return "refused"
    return "exact" if row["all_exact"] else "inexact"


def summarize(rows: list[dict]) -> dict[str, int]:
    statuses = [status(row) for row in rows]
    return {name: statuses.count(name) for name in ("exact", "refused", "inexact", "failed")}


def run(args: argparse.Namespace) -> dict:
    families = _names(args.families, "--families", list(TINY_ARCHITECTURES)) or list(TINY_ARCHITECTURES)
    from transformers import CONFIG_MAPPING

    model_types = _names(args.model_types, "--model-types", list(CONFIG_MAPPING.keys()), listed=False)
    _check_positive(args)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.torch_threads)
    try:
        rows = [
            measure(name, TINY_ARCHITECTURES[name][0], partial(_build_family, arch=name), args) for name in families
        ]
        rows += [
            measure(model_type, model_type, partial(build_other_model, model_type=model_type), args)
            for model_type in model_types
        ]
    finally:
        torch.set_num_threads(threads)
    return {
        "families": rows,
        "summary": summarize(rows),
        "settings": {
            "prompts": args.prompts,
            "max_tokens": args.max_tokens,
            "batch": args.batch,
            "input_len": args.input_len,
            "repeats": args.repeats,
            "dtype": "float32",
            "device": "cpu",
            "torch_threads": args.torch_threads,
            "tensor_parallel_size": args.tensor_parallel_size,
            "expert_parallel_size": args.expert_parallel_size,
        },
    }


if __name__ == "__main__":
    sys.exit(main("python -m benchmarks.model_families_bench", add_arguments, run))
