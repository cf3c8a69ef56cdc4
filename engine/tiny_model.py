"""A deterministic tiny random-weight model with a byte-level tokenizer, for fast tests.

Same code path as a real model (transformers model code of the family, a saved folder, a chat template), seconds to build. A
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


# the families the exactness tests cover, as transformers' ``model_type`` and the fields that make each one's tiny
# model exercise what sets it apart: sliding windows short enough for test prompts to leave them (Gemma 2/3,
# gpt-oss), soft-capping (Gemma 2), attention sinks (gpt-oss), mixtures of experts (Mixtral, Qwen3-MoE, gpt-oss,
# DeepSeek-V3), DeepSeek's latent attention, whose value heads are narrower than its key heads, and logits scaled by
# the model's head (Granite, Cohere)
TINY_WINDOW = 8
_ALTERNATING = ["sliding_attention", "full_attention", "sliding_attention"]
TINY_ARCHITECTURES: dict[str, tuple[str, dict[str, object]]] = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "gemma2": (
        "gemma2",
        {
            "sliding_window": TINY_WINDOW,
            "layer_types": _ALTERNATING,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 10.0,
            "query_pre_attn_scalar": 16,
        },
    ),
    "gemma3": ("gemma3_text", {"sliding_window": TINY_WINDOW, "layer_types": _ALTERNATING}),
    "phi3": ("phi3", {}),
    # heads that transform their logits (and Granite's multipliers in the decoder): the model's own head runs them
    "granite": (
        "granite",
        {"logits_scaling": 4.0, "embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.25},
    ),
    "cohere": ("cohere", {"logit_scale": 0.25}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": (
        "qwen3_moe",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True},
    ),
    "gpt_oss": (
        "gpt_oss",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": TINY_WINDOW,
            "layer_types": _ALTERNATING,
            # YaRN's factor matches the context it stretches to (transformers warns otherwise)
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 32.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
            },
        },
    ),
    "deepseek_v3": (
        "deepseek_v3",
        {
            "num_key_value_heads": 4,
            "kv_lora_rank": 32,
            "q_lora_rank": 48,
            "qk_rope_head_dim": 8,
            "head_dim": 8,  # DeepSeek's rotary width is its config's head_dim: the rope part of a key head
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "moe_intermediate_size": 32,
        },
    ),
}


def build_tiny_model(out: str | Path, arch: str = "llama", seed: int = 0, **shape: object) -> Path:
    """``shape``: config fields to change (``num_hidden_layers=30``), e.g. a model shaped for KV bytes, not compute."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out)
    tokenizer = build_byte_tokenizer()
    if arch not in TINY_ARCHITECTURES:
        raise ValueError(f"arch must be one of {', '.join(TINY_ARCHITECTURES)}, got {arch!r}")
    model_type, family = TINY_ARCHITECTURES[arch]
    fields = tiny_fields(tokenizer) | family | shape
    fields.setdefault("head_dim", int(fields["hidden_size"]) // int(fields["num_attention_heads"]))  # type: ignore[call-overload]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields))
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def tiny_fields(tokenizer) -> dict[str, object]:
    """The config fields every tiny model shares (any family's config takes them, or ignores what it lacks)."""
    return {
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
    }
