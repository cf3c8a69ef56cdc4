"""The engine a simulated worker runs: the real ``LLMEngine`` (scheduler, block manager, prefix cache, KV connector,
sampler, detokenizer) over parts whose forward computes nothing.

``sim_engine`` builds it with the worker's own block count, block size, batch bounds and prefix caching, but a KV
cache of one layer, one head and one value per token (a few bytes a block: the blocks' bookkeeping is what matters,
their contents are never read for a token). ``SimRunner.execute`` records the chunks of the step and returns logits
that make the sampler pick ``SIM_TOKEN``, never EOS (the planner's requests generate exactly their trace's length); the
simulated worker charges the step's profiled time for those chunks. Both token ids are special to the tokenizer, so
the detokenizer yields no text. The simulated model accepts any non-negative prompt id below 2^62 (the synthetic
prompts' ids are above 2^40); what a KV transfer weighs comes from the profile, not from this cache
(planner/sim_transfer.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import AttentionBatch, LayerHook
from engine.config import EngineConfig
from engine.engine_parts import EngineParts
from engine.kv_cache import KVCache, KVSpec
from engine.llm_engine import LLMEngine
from engine.model_probe import LayerAttention, ModelAttention
from engine.model_runner import StaticDecode, StepStats
from engine.sampler import PromptScores, Sampler
from engine.scheduler import ScheduledChunk
from engine.tensor_parallel import ExportSpan, HeadSplit, StepChannel

SIM_EOS, SIM_TOKEN = 0, 1  # the logits' two columns: EOS, never chosen, and the token every sample takes
SIM_PROMPT_VOCAB = 1 << 62  # prompt ids the simulated model accepts


@dataclass(frozen=True, slots=True)
class SimModelConfig:
    vocab_size: int = SIM_PROMPT_VOCAB


@dataclass(frozen=True, slots=True)
class SimModel:
    """What the engine reads of its model: the vocabulary its prompts are checked against."""

    config: SimModelConfig = SimModelConfig()


class SimTokenizer:
    """Enough of a tokenizer for ``engine.detokenizer`` (its slow-tokenizer path), and the cheapest: both ids are
    special tokens, so the detokenizer runs on every sampled token and yields no text (the text is not simulated)."""

    all_special_ids = [SIM_EOS, SIM_TOKEN]
    eos_token_id = SIM_EOS
    clean_up_tokenization_spaces = False

    def __len__(self) -> int:
        return 2

    def decode(
        self, ids: list[int], skip_special_tokens: bool = True, clean_up_tokenization_spaces: bool = False
    ) -> str:
        return "" if skip_special_tokens else "".join("<eos>" if token == SIM_EOS else "<x>" for token in ids)


class SimRunner:
    """The engine's runner with a forward that costs nothing: it runs the KV connector's layer hook (so a prefill's
    KV streams to its sink as in a forward), records the step's chunks for the simulated worker to charge, and
    returns logits whose maximum is ``SIM_TOKEN`` on every sampled row."""

    def __init__(self, kv_cache: KVCache) -> None:
        self.kv_cache = kv_cache
        self.layer_hook: LayerHook | None = None
        self.exports: list[ExportSpan] = []
        self.head_split: HeadSplit | None = None
        self.step_channel: StepChannel | None = None
        self.decode_graphs: StaticDecode | None = None
        self.ran: list[ScheduledChunk] = []  # the chunks of the last forward, until the worker takes them
        row = torch.full((1, 2), float("-inf"))
        row[0, SIM_TOKEN] = 0.0
        self._row = row
        self._empty_slots = torch.zeros(0, dtype=torch.long)

    def take(self) -> list[ScheduledChunk]:
        """The chunks the engine ran since the last call ([] when it ran no forward)."""
        ran, self.ran = self.ran, []
        return ran

    def execute(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, StepStats]:
        self.ran = chunks
        if self.layer_hook is not None:
            batch = AttentionBatch(kv_cache=self.kv_cache, slot_mapping=self._empty_slots, chunks=chunks)
            for layer in range(self.kv_cache.spec.num_layers):
                self.layer_hook(layer, batch)
        rows = num_tokens = decode = 0
        for chunk in chunks:
            rows += chunk.num_sampled_rows
            num_tokens += chunk.num_tokens
            if chunk.proposal or (chunk.num_tokens == 1 and chunk.start):
                decode += chunk.num_tokens
        stats = StepStats(num_tokens, len(chunks), num_tokens - decode, decode, 0.0)
        return self._row.expand(rows, 2).clone(), stats  # a fresh tensor: the sampler may write into its logits

    def score_prompts(self, chunks: list[ScheduledChunk]) -> list[PromptScores]:
        return []  # no request of the planner's asks for prompt logprobs


def sim_engine(
    num_blocks: int,
    block_size: int,
    max_batch_tokens: int,
    max_num_seqs: int,
    prefix_caching: bool,
    max_model_len: int | None,
    prefill_only: bool = False,
) -> LLMEngine:
    """An ``LLMEngine`` with a worker's bounds, on a one-layer, one-head, one-value KV cache and a ``SimRunner``."""
    config = EngineConfig(
        model="simulated",
        dtype="float32",
        block_size=block_size,
        kv_blocks=num_blocks,
        max_model_len=max_model_len,
        max_batch_tokens=max_batch_tokens,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=prefix_caching,
        prefill_only=prefill_only,
        cpu_linear_tuning=False,
    )
    layer = LayerAttention(1, 1, 1, 1, sliding_window=None, softcap=None, has_sinks=False)
    attention = ModelAttention("simulated", (layer,), final_logit_softcap=None)
    kv_spec = KVSpec.for_model("simulated", torch.float32, 1, 1, 1, block_size)
    kv_cache = KVCache(kv_spec, num_blocks)
    parts = EngineParts(
        config=config,
        model=SimModel(),
        tokenizer=SimTokenizer(),
        max_model_len=max_model_len or SIM_PROMPT_VOCAB,
        kv_spec=kv_spec,
        attention=attention,
        memory_plan=None,
        kv_cache=kv_cache,
        runner=SimRunner(kv_cache),
        eos_token_ids={SIM_EOS},
        vocab_size=2,
        sampler=Sampler({SIM_EOS}),
    )
    return LLMEngine(config, parts=parts)
