"""gpu-check's models and its transformers baselines: random-weight Llama models built in-process, never downloaded.

Shapes are the real checkpoints' (Llama-3.2-1B, Llama-3-8B; rope scaling left out: it changes no cost), plus a tiny
one for CI. Weights are drawn on the device in the run's dtype and saved once as a model folder with
engine.tiny_model's byte-level tokenizer, because the engine loads what a worker loads (ids the tokenizer lacks decode
to no text, which changes no token id). Random weights decode greedily into repeats, fine for comparing token ids; the
init range is wider than transformers' default so that a float32 comparison tests our arithmetic, not float ties.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from checks.gpu.gpu_check_time import NEVER, Deadline


@dataclass(frozen=True)
class Shape:
    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tie_word_embeddings: bool
    initializer_range: float

    def num_params(self) -> int:
        head_dim = self.hidden_size // self.num_attention_heads
        attn = self.hidden_size * head_dim * (2 * self.num_attention_heads + 2 * self.num_key_value_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        per_layer = attn + mlp + 2 * self.hidden_size
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + embed + self.hidden_size

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        head_dim = self.hidden_size // self.num_attention_heads
        return 2 * self.num_hidden_layers * self.num_key_value_heads * head_dim * dtype_bytes


SHAPES = {
    "llama-3.2-1b": Shape("llama-3.2-1b", 2048, 8192, 16, 32, 8, 128256, True, 0.05),
    "llama-3-8b": Shape("llama-3-8b", 4096, 14336, 32, 32, 8, 128256, False, 0.05),
    "tiny": Shape("tiny", 64, 128, 3, 4, 2, 512, False, 0.2),
}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def load_hf(folder: Path, device: str, dtype: torch.dtype) -> Any:
    """The saved model folder as transformers loads it, on ``device`` in ``dtype`` (the baselines' model)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map=device, attn_implementation="sdpa")
    model.eval()
    model.generation_config.eos_token_id = None
    return model


def build_model(shape: Shape, device: str, dtype: torch.dtype, seed: int = 0) -> Any:
    """A random-weight LlamaForCausalLM of ``shape``, drawn directly on ``device`` in ``dtype`` (no host copy)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.tiny_model import build_byte_tokenizer

    tokenizer = build_byte_tokenizer()
    config = LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        initializer_range=shape.initializer_range,
        tie_word_embeddings=shape.tie_word_embeddings,
        eos_token_id=None,  # random weights: nothing should stop a greedy run early, here or in generate()
        bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def save_folder(model: Any, tokenizer: Any, folder: Path) -> float:
    """Save the model as the engine loads models (config.json, safetensors, tokenizer); returns seconds taken."""
    t0 = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return time.perf_counter() - t0


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (count, length), generator=generator).tolist()


@torch.inference_mode()
def hf_greedy(model: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy ``generate`` (dynamic cache): the exactness reference. Prompts of one length, no padding."""
    device = next(model.parameters()).device
    ids = torch.tensor(prompts, device=device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
    )
    return out[:, ids.shape[1] :].tolist()


@torch.inference_mode()
def hf_top1(model: Any, prompt: list[int], tokens: list[int]) -> list[int]:
    """transformers' argmax at each generated position of ``prompt + tokens`` (teacher-forced, one forward)."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + tokens], device=device)
    logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    return logits.argmax(-1).tolist()


class _StopAfter:
    """Stop once ``n`` tokens are generated. The run timing the prompt's forward stops after 1 token but asks for as
    many new tokens as the full run: a static cache is sized by max_new_tokens, and a new shape is a recompile."""

    def __init__(self, prompt_len: int, n: int) -> None:
        self.prompt_len, self.n = prompt_len, n

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        done = input_ids.shape[1] - self.prompt_len >= self.n
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


def generate_compiles(device: str) -> bool:
    """transformers' ``generate`` compiles its decode step by itself for a static cache on CUDA (not on the CPU)."""
    return device.startswith("cuda")


@torch.inference_mode()
def hf_decode_tps(
    model: Any,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    device: str,
    vocab: int,
    compiled: bool,
    deadline: Deadline = NEVER,
    reps: int = 1,
) -> float:
    """Decode tokens/s of ``generate``: a run of new_tokens minus one stopped after 1 token (same cache shape), as the
    engine's figure. ``compiled``: a static cache (compiled on CUDA), else eager; both warmed up on the timed shapes."""
    from transformers import StoppingCriteriaList

    ids = torch.tensor(random_prompts(batch, prompt_len, vocab, seed=batch), device=device)
    mask = torch.ones_like(ids)
    cache = {"cache_implementation": "static"} if compiled else {"disable_compile": True}

    def run(stop_after: int) -> float:
        deadline.check(f"generate batch {batch}")
        sync(device)
        t0 = time.perf_counter()
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            do_sample=False,
            stopping_criteria=StoppingCriteriaList([_StopAfter(prompt_len, stop_after)]),
            **cache,
        )
        sync(device)
        return time.perf_counter() - t0

    run(new_tokens)  # warm-up: the compile (decode step) and the prompt's forward
    run(1)
    fulls, firsts = [], []
    for _ in range(reps):
        fulls.append(run(new_tokens))
        firsts.append(run(1))
    full, first = sorted(fulls)[len(fulls) // 2], sorted(firsts)[len(firsts) // 2]
    return batch * (new_tokens - 1) / max(full - first, 1e-9)


@torch.inference_mode()
def hf_prefill_tps(
    model: Any, count: int, length: int, device: str, vocab: int, reps: int = 3, deadline: Deadline = NEVER
) -> float:
    """Prompt tokens/s of a plain forward (no cache; the last position's logits only, as the engine projects only
    the rows that sample); the median of ``reps`` after a warm-up."""
    ids = torch.tensor(random_prompts(count, length, vocab, seed=7), device=device)
    times = []
    for _ in range(reps + 1):
        deadline.check("the plain forward")
        sync(device)
        t0 = time.perf_counter()
        model(ids, use_cache=False, logits_to_keep=1)
        sync(device)
        times.append(time.perf_counter() - t0)
    times = sorted(times[1:])
    return count * length / times[len(times) // 2]
