"""CUDA graphs for decode-only steps: one graph per (batch bucket, context bucket), replayed over static buffers.

At batch 1 an eager decode step is bound by its few hundred kernel launches; a graph replays them in one call but
fixes everything except its inputs' contents. So the batch is padded to a power-of-two bucket up to
``max_num_seqs``, the gather width (context blocks per row) to one up to ``max_model_len / block_size``; each such
*key* within ``max_gather_bytes`` gets at most one graph (``max_graphs`` in all), captured when first met (a workload
meets few keys; a prefill worker none). A key's inputs live in one packed int64 buffer (one copy per step), the mask
is built inside the graph, and padding rows and table padding point at the KV cache's ``padding_sink_block``; their
hidden states are dropped before the lm_head. A verified proposal's tokens are rows of their own, each attending up
to itself. Other steps run eagerly (``Fallback``). A graphed step attends with gather + SDPA whatever the eager
backend (the paged layout is shared). ``StaticStep.EAGER`` runs the same static path eagerly, as the CPU tests do;
the capture itself (``_capture``) has not run on a GPU. ``StaticStep.COMPILED`` (the CPU) runs it through
``torch.compile``: one graph per configured batch size, the context width dynamic, compiled ahead of time at
start-up and kept on disk (engine/compile_cache.py), so that a later start loads it (docs/speculative.md, "A
compiled CPU decode step").
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import enum
import functools
import json
import logging
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.attention import AttentionBatch, DecodeGroup, SdpaBackend
from engine.blocks import blocks_for_tokens
from engine.compile_cache import CompiledStore, KeptStepLoader, model_fingerprint, runtime_fields
from engine.config import EngineConfig
from engine.cpu_linear import CpuLinear
from engine.detached import Detached, start_detached
from engine.host_values import long_tensor
from engine.kv_cache import KVSpec
from engine.model_runner import ModelRunner, StepStats, sample_rows, wait_for_compute
from engine.scheduler import ScheduledChunk

logger = logging.getLogger(__name__)

DEFAULT_MAX_GRAPHS = 96  # more than the keys of max_num_seqs=128 x 8k context at the default gather budget (74)
DEFAULT_MAX_GATHER_BYTES = 512 * 1024 * 1024  # the static gather buffer: one layer's K+V of batch x context blocks
WARMUP_STEPS = 2  # eager runs on the capture stream before capture (lazy inits, cuBLAS workspaces, autotuning)
COMPILED_GRAPHS_PER_PROCESS = 256  # compiled static steps one process may hold (every engine's, every batch size)
LOADER_JOIN_S = 30.0  # the start waits this long for the smallest kept size's load, close() for one under way
NUM_STATIC_VECTORS = 4  # input ids, positions, slot mapping, context lengths: each [batch] in the packed buffer
# set by engine/background_compile.py: its process exists to keep the step on disk, so a step that cannot be kept is
# not compiled there at all (its parent would not load it)
KEEP_ONLY = False


class StaticStep(enum.Enum):
    """How a static step runs."""

    GRAPHS = "cuda-graphs"  # captured per key when first met, then replayed (CUDA)
    COMPILED = "compiled"  # torch.compile, one graph per batch bucket over every context width (the CPU)
    EAGER = "eager"  # the same static path, as it is (the CPU tests; the memory plan's measurement)


class Fallback(enum.Enum):
    """Why a step runs eagerly instead of on a decode graph."""

    NOT_DECODE = "prefill or mixed step"
    BATCH_TOO_LARGE = "batch over the largest bucket"
    GATHER_TOO_WIDE = "batch x context over max_gather_bytes"
    GRAPH_LIMIT = "max_graphs graphs exist and this key has none"
    PROMPT_LOGPROBS = "a request wants prompt logprobs"  # they need every position's hidden state
    LAYER_HOOK = "a layer hook is installed (streaming KV export)"  # Python per layer, which a graph cannot run
    CAPTURE_FAILED = "a capture or compile failed; static steps are off for this engine"
    COMPILING = "the compiled step is compiling in a background process"
    LOADING = "the compiled step of this batch size is still loading from disk (on a thread)"


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Powers of two below ``max_num_seqs``, then ``max_num_seqs`` itself: 64 -> [1, 2, 4, 8, 16, 32, 64]."""
    buckets = [1 << i for i in range(max_num_seqs.bit_length()) if 1 << i < max_num_seqs]
    return [*buckets, max_num_seqs]


def context_buckets(max_model_len: int, block_size: int) -> list[int]:
    """Gather widths in blocks: powers of two below the blocks of ``max_model_len``, then that count."""
    return batch_buckets(blocks_for_tokens(max_model_len, block_size))


def bucket_for(value: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds ``value``; None when the largest does not."""
    index = bisect.bisect_left(buckets, value)
    return buckets[index] if index < len(buckets) else None


def plan_keys(
    max_num_seqs: int, max_model_len: int, block_size: int, gather_block_bytes: int, max_gather_bytes: int
) -> list[tuple[int, int]]:
    """The keys that may get a graph: every (batch, context) bucket whose gather buffer (one layer's K, V) fits."""
    return [
        (batch, blocks)
        for batch in batch_buckets(max_num_seqs)
        for blocks in context_buckets(max_model_len, block_size)
        if batch * blocks * gather_block_bytes <= max_gather_bytes
    ]


def scratch_bytes_for(
    spec: KVSpec, max_num_seqs: int, max_model_len: int, max_gather_bytes: int = DEFAULT_MAX_GATHER_BYTES
) -> int:
    """Device memory ``DecodeGraphs`` holds outside its pool, known before the KV cache is sized to leave room."""
    gather_block_bytes = _gather_block_bytes(spec)
    gather_blocks = _max_gather_blocks(spec, max_num_seqs, max_model_len, max_gather_bytes)
    return gather_blocks * gather_block_bytes + (NUM_STATIC_VECTORS * max_num_seqs + gather_blocks) * 8


def _gather_block_bytes(spec: KVSpec) -> int:
    return 2 * spec.block_size * spec.num_kv_heads * spec.head_dim * spec.dtype.itemsize


def _max_gather_blocks(spec: KVSpec, max_num_seqs: int, max_model_len: int, max_gather_bytes: int) -> int:
    """Blocks the shared gather storage holds: the largest (batch, context) bucket's, capped by ``max_gather_bytes``."""
    largest = batch_buckets(max_num_seqs)[-1] * context_buckets(max_model_len, spec.block_size)[-1]
    return min(max_gather_bytes // _gather_block_bytes(spec), largest)


@dataclass(slots=True)
class _Key:
    batch: int  # rows, real and padding
    blocks: int  # gather width per row, in blocks


@dataclass(slots=True)
class _Entry:
    graph: torch.cuda.CUDAGraph | None  # None unless captured: the step function is called instead
    hidden: torch.Tensor | None  # the graph's static output [batch, hidden]; None without a graph


class DecodeGraphs:
    """Runs decode-only steps of a ``ModelRunner`` over static, padded buffers: CUDA graphs (``GRAPHS``), compiled
    (``COMPILED``, with ``compile_batches``: the batch buckets, each compiled by ``compile_all``) or eagerly."""

    def __init__(
        self,
        runner: ModelRunner,
        max_num_seqs: int,
        max_model_len: int,
        mode: StaticStep = StaticStep.GRAPHS,
        max_graphs: int = DEFAULT_MAX_GRAPHS,
        max_gather_bytes: int = DEFAULT_MAX_GATHER_BYTES,
        compile_batches: list[int] | None = None,
        cache_root: Path | None = None,
    ) -> None:
        if mode is StaticStep.GRAPHS and runner.device.type != "cuda":
            raise ValueError(f"CUDA graph capture needs a CUDA device, the model is on {runner.device}")
        if (mode is StaticStep.COMPILED) != bool(compile_batches):
            raise ValueError("compile_batches are the buckets of a compiled static step, and only of one")
        self.runner = runner
        self.mode = mode
        self.max_graphs = max_graphs
        kv_cache = runner.kv_cache
        spec = kv_cache.spec
        self.block_size = spec.block_size
        self.sink = kv_cache.padding_sink_block
        self.batch_buckets = sorted(set(compile_batches)) if compile_batches else batch_buckets(max_num_seqs)
        self.context_buckets = context_buckets(max_model_len, spec.block_size)
        if mode is StaticStep.COMPILED:  # a width of 1 would get a graph of its own (compilers specialise size 1)
            self.context_buckets = [w for w in self.context_buckets if w >= 2] or [2]
        block_elems = self._block_elems = spec.block_size * spec.num_kv_heads * spec.head_dim
        self.gather_block_bytes = _gather_block_bytes(spec)
        self.max_gather_blocks = _max_gather_blocks(spec, max_num_seqs, max_model_len, max_gather_bytes)
        device = runner.device
        # allocated once at their largest: a captured graph holds these addresses for its whole life. A compiled
        # step gathers into tensors of its own (an out= into this storage made the compiled graph copy all of it)
        stored_blocks = 0 if mode is StaticStep.COMPILED else self.max_gather_blocks
        self._gather_storage = torch.empty(2 * stored_blocks * block_elems, dtype=spec.dtype, device=device)
        width = NUM_STATIC_VECTORS * self.batch_buckets[-1] + self.max_gather_blocks
        self._inputs = torch.zeros(width, dtype=torch.long, device=device)
        self._staging = torch.zeros(width, dtype=torch.long, pin_memory=device.type == "cuda")
        self._attention = SdpaBackend()  # a static gather width is what makes a graph possible
        self._key_positions = torch.arange(self.context_buckets[-1] * spec.block_size, device=device)
        self._entries: dict[tuple[int, int], _Entry] = {}
        capture = mode is StaticStep.GRAPHS
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self._stream = torch.cuda.Stream(device) if capture else None
        self._compiled: dict[int, Callable[..., torch.Tensor]] = {}  # batch bucket -> its compiled step (COMPILED)
        self.compile_s: dict[int, float] = {}  # batch bucket -> seconds its compile (or its load from disk) took
        self.loaded: set[int] = set()  # the batch buckets loaded from disk rather than compiled here
        # None: the compiled steps are kept under $PDSERVE_CACHE/compiled (engine.compile_cache); a path: there
        self.cache_root = cache_root
        self._background: Detached | None = None  # the process compiling this step (engine.background_compile)
        self._loader: KeptStepLoader | None = None  # the thread loading the kept steps while the engine serves
        self._copied = torch.cuda.Event() if device.type == "cuda" else None  # the last staging copy is done
        self._broken = False  # a capture failed: every later step runs eagerly
        self.num_replays = 0
        self.steps: Counter[tuple[int, int]] = Counter()  # static steps run per (batch, context blocks) key
        self.fallbacks: Counter[Fallback] = Counter()  # eager steps per reason

    @property
    def scratch_bytes(self) -> int:
        """Device memory held outside the graph pool: the gather storage and the packed input buffer."""
        return self._gather_storage.numel() * self._gather_storage.element_size() + self._inputs.numel() * 8

    def planned_keys(self) -> list[tuple[int, int]]:
        """Every (batch bucket, context bucket in blocks) that may get a graph (``plan_keys``)."""
        return [(b, w) for b in self.batch_buckets for w in self.context_buckets if b * w <= self.max_gather_blocks]

    def output_bytes(self, batch: int) -> int:
        """A graph's static output, the hidden states of its padded batch: what it keeps in the pool."""
        return batch * int(self.runner.model.config.hidden_size) * self.runner.kv_cache.spec.dtype.itemsize

    @torch.inference_mode()
    def run_padding_step(self, batch: int, blocks: int) -> None:
        """A key's static step, every row padding, run eagerly: what the memory plan measures a graph's pool by."""
        key = _Key(batch, blocks)
        self._fill(None, key)
        self._forward_static(key)

    @torch.inference_mode()
    def warm(self, rows: int, max_context: int) -> int:
        """Capture now every graph a batch of ``rows`` meets while its longest context grows to ``max_context``
        (a capture synchronises the whole device, so a measurement must not meet one); returns how many."""
        batch = bucket_for(rows, self.batch_buckets)
        needed = bucket_for(blocks_for_tokens(max_context, self.block_size), self.context_buckets)
        if batch is None or needed is None or self.mode is not StaticStep.GRAPHS:
            return 0
        made = 0
        for blocks in self.context_buckets:
            if blocks > needed or batch * blocks > self.max_gather_blocks or (batch, blocks) in self._entries:
                continue
            if self.num_graphs >= self.max_graphs or self._broken:
                break
            self._entries[(batch, blocks)] = self._capture(_Key(batch, blocks))
            made += 1
        return made

    def pool_bytes(self) -> int | None:
        """Device memory the graphs' pool holds now (its segments in the allocator's snapshot); None without one."""
        if self._pool is None or not torch.cuda.is_available():
            return None
        pool = tuple(self._pool)
        return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", ())) == pool)

    @property
    def num_graphs(self) -> int:
        return sum(1 for entry in self._entries.values() if entry.graph is not None)

    # ---- which steps run here ----------------------------------------------------------------------------------

    def key_for(self, chunks: list[ScheduledChunk]) -> _Key | None:
        """The bucket of a decode-only batch (a verified proposal's tokens are rows of their own); None when the
        rows or their context are over the largest bucket."""
        batch = bucket_for(sum(chunk.num_tokens for chunk in chunks), self.batch_buckets)
        needed = max(blocks_for_tokens(chunk.end, self.block_size) for chunk in chunks)
        blocks = bucket_for(needed, self.context_buckets)
        return None if batch is None or blocks is None else _Key(batch, blocks)

    def fallback_reason(self, chunks: list[ScheduledChunk]) -> Fallback | None:
        """None when this step can run on a graph (or, without ``capture``, on the static path); else why not."""
        if self._background is not None:
            self.poll_background()
            if self._background is not None:
                return Fallback.COMPILING
        if self._loader is not None:
            self._install_loaded()
        if self._broken:
            return Fallback.CAPTURE_FAILED
        if not chunks or any(chunk.start == 0 or chunk.num_tokens != 1 and not chunk.proposal for chunk in chunks):
            return Fallback.NOT_DECODE
        if self.runner.layer_hook is not None:
            return Fallback.LAYER_HOOK
        if any(chunk.request.wants_prompt_logprobs for chunk in chunks):
            return Fallback.PROMPT_LOGPROBS
        key = self.key_for(chunks)
        if key is None:
            return Fallback.BATCH_TOO_LARGE
        if key.batch * key.blocks > self.max_gather_blocks:
            return Fallback.GATHER_TOO_WIDE
        if self._loader is not None and key.batch not in self._compiled:
            self._loader.want(key.batch)
            return Fallback.LOADING
        if (
            self.mode is StaticStep.GRAPHS
            and (key.batch, key.blocks) not in self._entries
            and self.num_graphs >= self.max_graphs
        ):
            return Fallback.GRAPH_LIMIT
        return None

    def can_run(self, chunks: list[ScheduledChunk]) -> bool:
        reason = self.fallback_reason(chunks)
        if reason is not None:
            self.fallbacks[reason] += 1
        return reason is None

    # ---- the step ----------------------------------------------------------------------------------------------

    def execute(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, StepStats]:
        """``ModelRunner.execute`` for a step ``can_run`` accepted; call under ``torch.inference_mode()``."""
        started = time.perf_counter()
        key = self.key_for(chunks)
        assert key is not None  # can_run checked it
        entry = self._entries.get((key.batch, key.blocks))
        if entry is None:
            captured = self._capture(key) if self.mode is StaticStep.GRAPHS else _Entry(None, None)
            entry = self._entries[(key.batch, key.blocks)] = captured
        self._fill(chunks, key)
        self.steps[(key.batch, key.blocks)] += 1
        if entry.graph is not None and entry.hidden is not None:
            entry.graph.replay()
            hidden = entry.hidden
            self.num_replays += 1
        elif self._compiled:
            hidden = self._run_compiled(key)
        else:
            hidden = self._forward_static(key)
        num_rows = sum(chunk.num_tokens for chunk in chunks)
        rows = sample_rows(chunks)  # in the packed row's order, as the eager step's
        real = hidden[:num_rows] if len(rows) == num_rows else hidden[long_tensor(rows, hidden.device)]
        # padding rows dropped before the vocabulary projection; a tensor-parallel rank but 0 projects nothing
        logits = self.runner.project(real) if self.runner.projects_logits else real[:0]
        wait_for_compute(self.runner.device, self.runner.tp_group)
        stats = StepStats(
            num_tokens=num_rows,
            num_seqs=len(chunks),
            num_prefill_tokens=0,
            num_decode_tokens=num_rows,
            duration_s=time.perf_counter() - started,
        )
        return logits, stats

    def _views(self, key: _Key) -> tuple[torch.Tensor, ...]:
        """The key's layout in the packed buffer: ids, positions, slots, context lengths [batch], table [batch, w]."""
        b = key.batch
        vectors = [self._inputs[i * b : (i + 1) * b] for i in range(NUM_STATIC_VECTORS)]
        end = NUM_STATIC_VECTORS * b
        table = self._inputs[end : end + b * key.blocks].view(b, key.blocks)
        return (*vectors, table)

    def _fill(self, chunks: list[ScheduledChunk] | None, key: _Key) -> None:
        """Write a step's inputs on the host (``chunks=None``: all padding, writing no request's KV), then one copy,
        once the event says the previous step's asynchronous copy has left the pinned buffer (usually long done)."""
        if self._copied is not None:
            self._copied.synchronize()
        b, w, bs, sink = key.batch, key.blocks, self.block_size, self.sink
        size = NUM_STATIC_VECTORS * b + b * w
        host = self._staging[:size].numpy()
        ids, positions, slots, lens = (host[i * b : (i + 1) * b] for i in range(NUM_STATIC_VECTORS))
        table = host[NUM_STATIC_VECTORS * b :].reshape(b, w)
        ids[:] = 0
        positions[:] = 0
        slots[:] = sink * bs
        lens[:] = 1
        table[:] = sink
        # one row per token: a verified proposal's tokens are rows that each attend up to themselves, reading the
        # KV every row of the step wrote before the gather (the causal verification, as one query per row)
        row = 0
        for chunk in chunks or ():
            request = chunk.request
            for offset, token in enumerate(chunk.token_ids()):  # the known token, then the proposal's
                position = chunk.start + offset
                ids[row] = token
                positions[row] = position
                slots[row] = request.block_ids[position // bs] * bs + position % bs
                lens[row] = position + 1
                needed = blocks_for_tokens(position + 1, bs)
                table[row, :needed] = request.block_ids[:needed]
                row += 1
        self._inputs[:size].copy_(self._staging[:size], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def _forward_static(self, key: _Key) -> torch.Tensor:
        """The function a graph captures: the decoder over the padded batch, reading only static buffers; returns
        the hidden states ``[batch, hidden]``. Padding rows attend only to the sink block's first slot."""
        return self._step(*self._views(key))

    def _step(
        self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor, table: torch.Tensor
    ) -> torch.Tensor:
        """``_forward_static`` over a key's views (``_views``): what ``torch.compile`` traces."""
        batch_rows, blocks = table.shape
        width = blocks * self.block_size
        mask = (self._key_positions[:width].unsqueeze(0) < lens.unsqueeze(1)).view(batch_rows, 1, 1, width)
        spec = self.runner.kv_cache.spec
        gather = None
        if self.mode is not StaticStep.COMPILED:
            stored = self._gather_storage[: 2 * batch_rows * blocks * self._block_elems]
            gather = stored.view(2, batch_rows * blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        group = DecodeGroup(
            token_index=None, block_table=table, max_context=width, gather_buffer=gather, mask=mask, context_lens=lens
        )
        batch = AttentionBatch(kv_cache=self.runner.kv_cache, slot_mapping=slots, decode=group, backend=self._attention)
        out = self.runner.run_decoder(ids.view(1, -1), positions.view(1, -1), batch)
        return out.last_hidden_state[0]

    def _run_compiled(self, key: _Key) -> torch.Tensor:
        """The key's batch bucket's compiled step. One it cannot take (its graph's guards fail, or the plain
        ``torch.compile`` step would compile again: a minute on a CPU, mid-serving) runs eagerly instead, and so does
        every later step of this engine (``CAPTURE_FAILED``)."""
        try:
            if key.batch not in self._compiled:
                raise RuntimeError(f"Detected recompile: no step was compiled for batch {key.batch}")
            with torch.compiler.set_stance("fail_on_recompile"):
                return self._compiled[key.batch](*self._views(key))
        except RuntimeError as e:
            if "Detected recompile" not in str(e) and "GuardManager check failed" not in str(e):
                raise
            logger.warning("the compiled decode step cannot run %s; decode runs eagerly: %s", key, e)
            self._broken, self._compiled = True, {}
            return self._forward_static(key)

    def cache_fields(self) -> dict[str, object]:
        """What the compiled graphs depend on: the key of their entry on disk (engine.compile_cache)."""
        runner = self.runner
        cache = runner.kv_cache
        linear = next((m for m in runner.model.modules() if isinstance(m, CpuLinear)), None)
        return runtime_fields() | {
            "model": model_fingerprint(runner.model),
            "kv": [str(cache.spec), len(cache.kv), list(cache.kv[0].shape)],
            "context_buckets": [self.context_buckets[0], self.max_gather_blocks],
            "linear_forms": None if linear is None else [f.value for f in linear.table.forms],
            "packed_weights": linear is not None and linear.packed,
            "softcap": runner.final_logit_softcap,
            "windows": sorted(runner.sliding_windows),
            "head_split": str(runner.head_split),
            "threads": torch.get_num_threads(),
        }

    def _keeps_on_disk(self) -> bool:
        """At a tensor-parallel degree above 1 the graphs name their process's own device group: not kept."""
        return self.runner.tp_group is None or self.runner.tp_group.size == 1

    def start_background(self, config: EngineConfig) -> None:
        """If the step's entry holds every bucket, load the smallest now and each other when a step first meets it
        (``KeptStepLoader``); else compile it in a background process, then load it so (``poll_background``). A
        bucket not loaded yet runs eagerly. At a degree above 1 the ranks compile now, together."""
        if not self._keeps_on_disk():
            self.compile_all()
            return
        store = CompiledStore(self.cache_fields(), self.cache_root)
        try:
            with store.locked(wait=False):  # held elsewhere: another process compiles it, which the child waits for
                held = store.verified_batches()
        except OSError:
            held = set()
        if set(self.batch_buckets) <= held:
            # the smallest size (a lone stream's) before serving: about 2 s, most of it the compiler's imports, which
            # a load beside the first requests' steps slowed as much as it saved (docs/speculative.md); the other
            # sizes when a step first meets them
            self._loader = KeptStepLoader(store, self.batch_buckets, verified=held)
            self._loader.want(self.batch_buckets[0])
            self._loader.wait_loaded(self.batch_buckets[0], LOADER_JOIN_S)
            self._install_loaded()
            return
        self._background = _start_background_compile(config)
        logger.info(
            "the decode step for batches %s is compiling in process %d (%s); decode runs eagerly until it is done",
            self.batch_buckets,
            self._background.pid,
            store.dir,
        )

    def poll_background(self) -> None:
        """Between steps: once the background compile has exited, load what it kept on a thread (or stay eager)."""
        assert self._background is not None
        returncode = self._background.poll()
        if returncode is None:
            return
        self._background = None
        if returncode != 0:
            logger.warning("the background compile exited with %d; decode stays eager", returncode)
            self._broken = True
            return
        self._loader = KeptStepLoader(CompiledStore(self.cache_fields(), self.cache_root), self.batch_buckets)

    @torch.inference_mode()
    def _install_loaded(self) -> None:
        """Between steps: each step the loader has read runs once on padding (its kernels load, its guards are
        checked, on this thread: it writes the static inputs) and then serves its batch bucket. A loader that failed
        leaves the engine eager, as a failed compile does."""
        loader = self._loader
        assert loader is not None
        for batch, function in list(loader.loaded.items()):
            if batch in self._compiled:
                continue
            started = time.perf_counter()
            key = _Key(batch, self.context_buckets[0])
            step = functools.partial(function, self)
            try:
                self._fill(None, key)
                step(*self._views(key))
            except Exception as exc:  # noqa: BLE001 - a file the manifest vouched for, but unusable here
                loader.error = f"the step for batch {batch} does not run: {type(exc).__name__}: {exc}"
                break
            self._compiled[batch] = step
            self.loaded.add(batch)
            self.compile_s[batch] = round(loader.seconds[batch] + time.perf_counter() - started, 3)
            logger.info("decode step for batch %d loaded from disk in %.1f s", batch, self.compile_s[batch])
        if loader.error is not None:
            logger.warning("the kept decode step did not load (%s); decode runs eagerly", loader.error)
            loader.close(0.0)  # told to stop; what it loads meanwhile is dropped
            self._loader, self._broken, self._compiled = None, True, {}
        elif set(self._compiled) == set(self.batch_buckets):
            self._loader = None

    @torch.inference_mode()
    def compile_all(self) -> dict[int, float]:
        """Compile the static step for every batch bucket now, each over all context widths (the table's width is
        dynamic), or load it from disk where an earlier start kept it (engine.compile_cache); returns seconds per
        bucket. Each graph runs once on padding here (its kernels load, its guards are checked). A model whose step
        does not trace as one graph, and a degree above 1, take plain ``torch.compile``, compiled at every start. A
        compile that fails leaves the engine eager (``CAPTURE_FAILED``): eager is always correct."""
        assert self.mode is StaticStep.COMPILED
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

        plain = not self._keeps_on_disk()
        try:
            if not plain:
                store = CompiledStore(self.cache_fields(), self.cache_root)
                with contextlib.ExitStack() as held:
                    try:
                        held.enter_context(store.locked())
                    except OSError as exc:  # nowhere to keep it: compiled here, as at every start
                        logger.warning("the compiled decode step cannot be kept in %s: %s", store.root, exc)
                        plain = True
                    else:
                        held.enter_context(temporary_cache_dir(str(store.inductor_dir)))
                        plain = not self._compile_ahead(store)
            if plain and KEEP_ONLY:
                raise RuntimeError("this decode step cannot be kept on disk: the background compile has none to keep")
            if plain:
                self._compile_plain()
        except Exception:
            logger.exception("compiling the decode step failed; decode runs eagerly")
            self._broken, self._compiled = True, {}
        return self.compile_s

    def _compile_ahead(self, store: CompiledStore) -> bool:
        """Load or compile ahead of time every bucket's step, keeping what it compiles in ``store``; False: the step
        does not trace as one graph (nothing kept)."""
        held = store.verified_batches()
        steps: dict[int, Callable[..., torch.Tensor]] = {}  # kept off self until the end: a later bucket's trace
        # serializes the guards' view of self, which a compiled step's own guard manager cannot join
        for number, batch in enumerate(self.batch_buckets, 1):
            started = time.perf_counter()
            key = _Key(batch, self.context_buckets[0])
            self._fill(None, key)
            step = self._load(store, batch, key) if batch in held else None
            if step is None:
                if held and batch in held:  # listed but not loadable: the entry is not trusted
                    store.clear()
                    held = set()
                try:
                    compiled = self._aot_compile(key)
                except torch._dynamo.exc.Unsupported as exc:
                    logger.info("the decode step does not compile as one graph (%s): compiled at every start", exc)
                    return False
                except Exception as exc:  # noqa: BLE001 - e.g. a tensor whose guards do not serialize: the step
                    # still compiles, only not ahead of time
                    logger.warning(
                        "the decode step cannot be compiled ahead of time and kept (%s: %s): compiled at every start",
                        type(exc).__name__,
                        exc,
                    )
                    store.clear()
                    return False
                store.dir.mkdir(parents=True, exist_ok=True)
                compiled.save_compiled_function(str(store.graph_path(batch)))
                step = functools.partial(compiled, self)
                step(*self._views(key))
                held.add(batch)
                store.record(held)
            else:
                self.loaded.add(batch)
            steps[batch] = step
            self.compile_s[batch] = round(time.perf_counter() - started, 3)
            logger.info(
                "decode step for batch %d %s in %.1f s (%d/%d, %s)",
                batch,
                "loaded from disk" if batch in self.loaded else "compiled",
                self.compile_s[batch],
                number,
                len(self.batch_buckets),
                store.dir,
            )
        self._compiled = steps
        return True

    def _aot_compile(self, key: _Key) -> Any:  # torch._dynamo.aot_compile.AOTCompiledFunction
        views = self._views(key)
        torch._dynamo.mark_dynamic(views[-1], 1)  # the table's width: one graph for every context bucket
        # guards on the inputs' shapes, dtypes and strides only: the store's key stands for the rest. Inductor's
        # runtime asserts (each extern kernel's output sizes and strides, alignments, scalars) are checks of its own
        # codegen, some 340 Python calls a SmolLM2 step at batch 1: 0.5 ms of its 21 (docs/benchmarks.md, section 17)
        options: dict[str, Any] = {
            "guard_filter_fn": torch.compiler.keep_tensor_guards_unsafe,
            "size_asserts": False,
            "alignment_asserts": False,
            "scalar_asserts": False,
        }
        compiled: Any = torch.compile(self._step, fullgraph=True, dynamic=False, options=options)
        return compiled.aot_compile((views, {}))

    def _load(self, store: CompiledStore, batch: int, key: _Key) -> Callable[..., torch.Tensor] | None:
        """The kept step of ``batch``, run once on padding; None when it does not load or run."""
        try:
            with store.vec_isas_kept(), store.graph_path(batch).open("rb") as f:
                step = functools.partial(torch.compiler.load_compiled_function(f), self)
            step(*self._views(key))
        except Exception as exc:  # a file the manifest vouched for, but this torch cannot use: compile again
            logger.warning("the kept decode step for batch %d did not load (%r): compiling it again", batch, exc)
            return None
        return step

    def _compile_plain(self) -> None:
        """``torch.compile`` (dynamo traces at every start; inductor's own cache may spare its kernels' compile)."""
        compiled = torch.compile(self._step, dynamic=False)
        # every engine of a process (in-process workers, other models) adds its graphs to this one function's: past
        # dynamo's limit of 8 it would run the step eagerly without a word. While serving nothing compiles anyway
        with torch._dynamo.config.patch(recompile_limit=COMPILED_GRAPHS_PER_PROCESS):
            for batch in self.batch_buckets:
                key = _Key(batch, self.context_buckets[0])
                started = time.perf_counter()
                self._fill(None, key)
                views = self._views(key)
                torch._dynamo.mark_dynamic(views[-1], 1)
                compiled(*views)
                self._compiled[batch] = compiled
                self.compile_s[batch] = round(time.perf_counter() - started, 3)
                logger.info("compiled the decode step for batch %d in %.1f s", batch, self.compile_s[batch])

    def _capture(self, key: _Key) -> _Entry:
        """Warm up on the capture stream, then record ``_forward_static(key)`` into a graph in the shared pool.

        Every row is padding, so warm-up writes only the sink block. ``thread_local`` capture mode: a transfer
        thread's CUDA calls (a cudaMalloc, a sync) do not invalidate it. A failed capture turns graphs off for this
        engine rather than failing requests: eager is always correct."""
        assert self._stream is not None
        device = self.runner.device
        started = time.perf_counter()
        self._fill(None, key)
        try:
            torch.cuda.synchronize(device)
            self._stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self._stream):
                for _ in range(WARMUP_STEPS):
                    self._forward_static(key)
            torch.cuda.current_stream(device).wait_stream(self._stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"):
                hidden = self._forward_static(key)
            torch.cuda.synchronize(device)
        except Exception:
            logger.exception("CUDA graph capture of decode bucket %s failed; decode runs eagerly from now on", key)
            self._broken = True
            return _Entry(None, None)
        logger.info(
            "captured decode graph batch=%d context_blocks=%d in %.3f s (%d graphs)",
            key.batch,
            key.blocks,
            time.perf_counter() - started,
            self.num_graphs + 1,
        )
        return _Entry(graph, hidden)

    def close(self) -> None:
        """Drop every graph and its pool memory; the engine calls it when it shuts down. A load under way is waited
        for (briefly): its thread holds the entry's lock."""
        if self._loader is not None:
            self._loader.close(LOADER_JOIN_S)
            self._loader = None
        self._entries.clear()
        self._pool = None


def uses_decode_graphs(config: EngineConfig) -> bool:
    """On CUDA when ``config.cuda_graphs``; not on the CPU (no launch overhead to hide) nor when prefill-only."""
    return config.cuda_graphs and config.device.startswith("cuda") and not config.prefill_only


def uses_compiled_decode(config: EngineConfig) -> bool:
    """On the CPU when ``config.compile_decode_batches`` lists batch sizes; not when prefill-only."""
    return bool(config.compile_decode_batches) and config.device == "cpu" and not config.prefill_only


def graph_scratch_bytes(config: EngineConfig, spec: KVSpec, max_model_len: int) -> int:
    """What the decode graphs will hold outside their pool (0 without): the KV plan counts it before they exist."""
    return scratch_bytes_for(spec, config.max_num_seqs, max_model_len) if uses_decode_graphs(config) else 0


def decode_graphs_for(runner: ModelRunner, config: EngineConfig, max_model_len: int) -> DecodeGraphs | None:
    """The engine's static decode steps: CUDA graphs, or on the CPU a compiled step (compiled here, at start-up)."""
    if uses_compiled_decode(config):
        batches = list(config.compile_decode_batches or ())
        graphs = DecodeGraphs(runner, config.max_num_seqs, max_model_len, StaticStep.COMPILED, compile_batches=batches)
        if config.compile_decode_background:
            graphs.start_background(config)
        else:
            graphs.compile_all()
        return graphs
    if not uses_decode_graphs(config):
        return None
    if runner.backend.name != SdpaBackend.name:
        logger.info("decode graphs attend with gather+SDPA; eager steps use %s", runner.backend.name)
    return DecodeGraphs(runner, config.max_num_seqs, max_model_len)


def _start_background_compile(config: EngineConfig) -> Detached:
    """The process compiling ``config``'s decode step into its entry on disk (engine/background_compile.py),
    detached: it finishes even if this process stops first. Its progress goes to stderr, the worker's log."""
    settings = dataclasses.asdict(dataclasses.replace(config, compile_decode_background=False))
    argv = [sys.executable, "-m", "engine.background_compile", json.dumps(settings)]
    return start_detached(argv, os.environ | {"PYTHONUNBUFFERED": "1"})
