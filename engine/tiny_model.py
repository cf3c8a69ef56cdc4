"""A deterministic tiny random-weight model with a byte-level tokenizer, for fast tests.

Same code path as a real model (transformers Llama or Qwen2, a saved folder, a chat template), seconds to build. A
fixed seed and a wide init keep logits well separated, so greedy comparisons test our arithmetic, not float ties.
"""

from __future__ import annotations

from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        bos_token=None,
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


# every architecture pdserve serves (engine.model_loader.SUPPORTED_ARCHITECTURES): transformers' config and model
TINY_ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}


def build_tiny_model(out: str | Path, arch: str = "llama", seed: int = 0, **shape: int) -> Path:
    """``shape``: config fields to change (``num_hidden_layers=30``), e.g. a model shaped for KV bytes, not compute."""
    import transformers

    out = Path(out)
    tokenizer = build_byte_tokenizer()
    common = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "initializer_range": 0.2,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": None,
        "tie_word_embeddings": False,
    } | shape
    if arch not in TINY_ARCHITECTURES:
        raise ValueError(f"arch must be one of {', '.join(TINY_ARCHITECTURES)}, got {arch!r}")
    config_name, model_name = TINY_ARCHITECTURES[arch]
    common.setdefault("head_dim", common["hidden_size"] // common["num_attention_heads"])  # Qwen3's default is 128
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**common))
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
