"""FlashInfer's paged attention kernels, reading our KV cache in place (no gather).

Each layer's ``kv[0]`` and ``kv[1]`` are FlashInfer's ``NHD`` pages (a page is one of our blocks), handed over as
``(k, v)``. ``prepare`` describes the batch in CSR form (``PagedKVMetadata``) on the host, once per step; the first
layer's ``forward`` plans the wrapper (it needs the query's heads, dtype and scale), later layers only run. A
decode-only step uses the decode wrapper (tensor cores from 4 query heads per KV head, as vLLM), any other the prefill
wrapper, whose causal mask is aligned to the end of each sequence's KV. Written against flashinfer-python 0.6.13 and
not yet run on a GPU (the CPU tests cover metadata, selection and call signatures); first use JIT-compiles the kernels
(minutes for the fa3 prefill on Hopper) unless flashinfer-cubin / flashinfer-jit-cache are installed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.attention.batch import AttentionBackend, AttentionBatch, LayerFeatures

# the float workspace (split-KV partial results), shared by both wrappers; 128 MiB can be short for a few hundred
# decode rows with split KV, and vLLM uses 256 MiB
WORKSPACE_BYTES = 256 * 1024 * 1024
TENSOR_CORE_GROUP = 4  # query heads per KV head from which the decode kernel uses tensor cores


@dataclass(slots=True)
class PagedKVMetadata:
    """FlashInfer's description of a batch (int32, on the host: ``plan`` copies it to the device itself)."""

    qo_indptr: torch.Tensor  # [N + 1] offset of sequence i's first query token in the packed row
    kv_indptr: torch.Tensor  # [N + 1] offset of sequence i's first page in kv_indices
    kv_indices: torch.Tensor  # [kv_indptr[-1]] the block ids in use, sequence after sequence
    kv_last_page_len: torch.Tensor  # [N] tokens in sequence i's last page (1..block_size)


def paged_kv_metadata(
    q_lens: list[int], context_lens: list[int], block_table: torch.Tensor, block_size: int
) -> PagedKVMetadata:
    """CSR page lists from a padded block table ``[N, max_blocks]``: sequence i uses its first
    ``ceil(context_lens[i] / block_size)`` blocks; blocks past that (allocated ahead, padding) are left out."""
    if len(q_lens) != len(context_lens) or block_table.shape[0] != len(context_lens):
        raise ValueError("q_lens, context_lens and block_table must describe the same sequences")
    context = torch.tensor(context_lens, dtype=torch.int32)
    if bool((context <= 0).any()):
        raise ValueError("every sequence needs at least one token of context")
    pages = (context + block_size - 1) // block_size
    if bool((pages > block_table.shape[1]).any()):
        raise ValueError("a sequence's context is longer than its block table row")
    kv_indptr = torch.zeros(len(context_lens) + 1, dtype=torch.int32)
    torch.cumsum(pages, 0, out=kv_indptr[1:])
    qo_indptr = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0, out=qo_indptr[1:])
    used = torch.arange(block_table.shape[1]).unsqueeze(0) < pages.unsqueeze(1)  # [N, max_blocks]
    kv_indices = block_table.cpu()[used].to(torch.int32)  # row-major: sequence after sequence, blocks in order
    last_page_len = (context - 1) % block_size + 1
    return PagedKVMetadata(qo_indptr, kv_indptr, kv_indices, last_page_len)


@dataclass(slots=True)
class FlashInferStep:
    metadata: PagedKVMetadata
    decode_only: bool
    planned_for: tuple | None = None  # (heads, kv_heads, head_dim, scale, dtype) the wrapper was planned with


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"
    needs_layout = True

    def __init__(self, device: torch.device | str) -> None:
        import flashinfer  # imported here: select_backend checks it is importable, and the CPU never loads it

        self._flashinfer: Any = flashinfer
        self.device = torch.device(device)
        # FlashInfer requires a zeroed workspace for its first use
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._decode: dict[bool, Any] = {}  # by use_tensor_cores, made on first use

    def workspace_bytes(self) -> int:
        return WORKSPACE_BYTES

    def prepare(self, batch: AttentionBatch) -> None:
        layout = batch.layout
        if layout is None:
            raise RuntimeError("the flashinfer attention backend needs the batch's SeqLayout")
        metadata = paged_kv_metadata(
            layout.q_lens, layout.context_lens, layout.host_block_table, batch.kv_cache.spec.block_size
        )
        batch.plan = FlashInferStep(metadata, decode_only=all(q == 1 for q in layout.q_lens))

    def _decode_wrapper(self, use_tensor_cores: bool) -> Any:
        if use_tensor_cores not in self._decode:
            self._decode[use_tensor_cores] = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_tensor_cores=use_tensor_cores
            )
        return self._decode[use_tensor_cores]

    def _plan(self, step: FlashInferStep, signature: tuple, kv_dtype: torch.dtype, block_size: int) -> None:
        heads, kv_heads, head_dim, scale, q_dtype = signature
        m = step.metadata
        if step.decode_only:
            wrapper = self._decode_wrapper(heads // kv_heads >= TENSOR_CORE_GROUP)
            wrapper.plan(
                m.kv_indptr,
                m.kv_indices,
                m.kv_last_page_len,
                heads,
                kv_heads,
                head_dim,
                block_size,
                pos_encoding_mode="NONE",  # the model applied rotary embeddings already
                sm_scale=scale,
                q_data_type=q_dtype,
                kv_data_type=kv_dtype,
            )
        else:
            self._prefill.plan(
                m.qo_indptr,
                m.kv_indptr,
                m.kv_indices,
                m.kv_last_page_len,
                heads,
                kv_heads,
                head_dim,
                block_size,
                causal=True,
                sm_scale=scale,
                q_data_type=q_dtype,
                kv_data_type=kv_dtype,
            )
        step.planned_for = signature

    def forward(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        batch: AttentionBatch,
        features: LayerFeatures,
    ) -> torch.Tensor:
        step = batch.plan
        if not isinstance(step, FlashInferStep):
            raise RuntimeError("flashinfer attention called before FlashInferBackend.prepare")
        heads, head_dim = query.shape[1], query.shape[3]
        scale = features.scaling
        signature = (heads, key.shape[1], head_dim, float(scale), query.dtype)
        cache = batch.kv_cache.kv[layer]
        if step.planned_for != signature:  # the first layer of the step (every later one has the same shapes)
            self._plan(step, signature, cache.dtype, batch.kv_cache.spec.block_size)
        q = query[0].transpose(0, 1).contiguous()  # [T, H, d]
        wrapper = (
            self._decode_wrapper(heads // key.shape[1] >= TENSOR_CORE_GROUP) if step.decode_only else self._prefill
        )
        out = wrapper.run(q, (cache[0], cache[1]))  # [T, H, d]
        return out.unsqueeze(0)
