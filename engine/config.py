"""Engine settings: what one worker's engine needs to know. Validated on construction; errors name the field."""

from __future__ import annotations

from dataclasses import dataclass

from engine.model_loader import DEFAULT_MODEL, DTYPES


@dataclass(slots=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None  # explicit block count; otherwise from kv_cache_memory_bytes
    kv_cache_memory_bytes: int = 256 * 1024 * 1024
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_batch_tokens: int = 2048  # tokens per forward: longer prompts are prefilled in chunks
    max_num_seqs: int = 64  # requests in the running batch
    enable_prefix_caching: bool = True
    torch_threads: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        for name in ("block_size", "max_batch_tokens", "max_num_seqs", "kv_cache_memory_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("num_kv_blocks", "max_model_len", "torch_threads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive integer or null, got {value!r}")
