"""How many KV blocks a request needs: the one rule the engine and the router share.

The router decides which decode worker can take a request by the blocks it will reserve there, and the decode
worker's engine allocates exactly that many; if the two computed it apart, the router would send work a worker then
refuses (or leave blocks idle). So both call these functions. Pure integer arithmetic: this module imports nothing
heavy (no torch), because the router imports it.

A reservation for a request whose KV arrives from a prefill worker covers the prompt, the first generated token (the
prefill worker samples it; its KV is computed by the first decode step here) and ``headroom_tokens`` more, capped at
what the request can still generate (``max_tokens - 1`` after the first token, and the room left under
``max_model_len``). Within the reservation, decoding never has to ask for a block.
"""

from __future__ import annotations


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens' KV (the last one may be partial)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return -(-max(0, num_tokens) // block_size)


def reserved_tokens(
    num_prompt_tokens: int, max_tokens: int, headroom_tokens: int, max_model_len: int | None = None
) -> int:
    """Token slots a remote-KV reservation covers: prompt + first token + headroom (capped; never negative)."""
    headroom = min(headroom_tokens, max_tokens - 1)
    if max_model_len is not None:
        headroom = min(headroom, max_model_len - num_prompt_tokens - 1)
    return num_prompt_tokens + 1 + max(0, headroom)


def reserved_blocks(
    num_prompt_tokens: int,
    max_tokens: int,
    headroom_tokens: int,
    block_size: int,
    max_model_len: int | None = None,
) -> int:
    """Blocks a decode worker's engine reserves for a request (``LLMEngine.reserve_remote`` allocates exactly these)."""
    return blocks_for_tokens(reserved_tokens(num_prompt_tokens, max_tokens, headroom_tokens, max_model_len), block_size)


def complete_prompt_blocks(num_computed_tokens: int, num_prompt_tokens: int, block_size: int) -> int:
    """Leading blocks of a prompt whose KV is final once ``num_computed_tokens`` positions are computed: the full
    blocks, and the partial last block as soon as the whole prompt is (the KV export's rule)."""
    if num_computed_tokens >= num_prompt_tokens:
        return blocks_for_tokens(num_prompt_tokens, block_size)
    return num_computed_tokens // block_size
