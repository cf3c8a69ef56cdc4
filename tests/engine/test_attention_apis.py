"""The attention backends' use of library APIs that only run on a GPU, checked on the CPU.

FlashInfer is not installed here and its kernels need CUDA, so ``flashinfer`` is replaced by a module whose wrapper
classes have the exact signatures of flashinfer-python 0.6.13 (copied from its source) and whose kernels return
zeros: what is checked is that every call our backend makes binds to those signatures with the arguments FlashInfer
documents (NHD layout, int32 host indices, bottom-right causal prefill, a 256 MiB workspace), across the layers of
real decode and prefill steps; not the kernels' numbers. Flex: on CUDA both the attention and the block mask are
compiled, once per process.
"""

from __future__ import annotations

import inspect
import sys
import types

import pytest
import torch

import engine.attention.flex as flex
from engine.attention.flashinfer_backend import WORKSPACE_BYTES, FlashInferBackend
from engine.model_runner import ModelRunner
from engine.request import SamplingParams
from engine.scheduler import ScheduledChunk
from tests.helpers.engine import random_prompts

MIB = 1024 * 1024


class _Recorder:
    calls: list[tuple[str, str, inspect.BoundArguments]] = []

    def _record(self, method: str, *args, **kwargs) -> inspect.BoundArguments:
        bound = inspect.signature(getattr(type(self), method)).bind(self, *args, **kwargs)
        bound.apply_defaults()
        _Recorder.calls.append((type(self).__name__, method, bound))
        return bound


class BatchPrefillWithPagedKVCacheWrapper(_Recorder):  # flashinfer 0.6.13, prefill.py
    def __init__(
        self,
        float_workspace_buffer,
        kv_layout="NHD",
        use_cuda_graph=False,
        qo_indptr_buf=None,
        paged_kv_indptr_buf=None,
        paged_kv_indices_buf=None,
        paged_kv_last_page_len_buf=None,
        custom_mask_buf=None,
        mask_indptr_buf=None,
        backend="auto",
        jit_args=None,
        jit_kwargs=None,
    ):
        self._record("__init__", **{k: v for k, v in locals().items() if k != "self"})

    def plan(
        self,
        qo_indptr,
        paged_kv_indptr,
        paged_kv_indices,
        paged_kv_last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim_qk,
        page_size,
        head_dim_vo=None,
        custom_mask=None,
        packed_custom_mask=None,
        causal=False,
        pos_encoding_mode="NONE",
        use_fp16_qk_reduction=False,
        sm_scale=None,
        window_left=-1,
        logits_soft_cap=None,
        rope_scale=None,
        rope_theta=None,
        q_data_type="float16",
        kv_data_type=None,
        o_data_type=None,
        non_blocking=True,
        prefix_len_ptr=None,
        token_pos_in_items_ptr=None,
        token_pos_in_items_len=0,
        max_item_len_ptr=None,
        seq_lens=None,
        seq_lens_q=None,
        block_tables=None,
        max_token_per_sequence=None,
        max_sequence_kv=None,
        fixed_split_size=None,
        disable_split_kv=False,
    ):
        self._record("plan", **{k: v for k, v in locals().items() if k != "self"})

    def run(
        self,
        q,
        paged_kv_cache,
        *,
        k_scale=None,
        v_scale=None,
        out=None,
        lse=None,
        return_lse=False,
        enable_pdl=None,
        window_left=None,
        sinks=None,
        kv_cache_sf=None,
        skip_softmax_threshold_scale_factor=None,
    ):
        self._record("run", q, paged_kv_cache)
        return torch.zeros_like(q)


class BatchDecodeWithPagedKVCacheWrapper(_Recorder):  # flashinfer 0.6.13, decode.py
    def __init__(
        self,
        float_workspace_buffer,
        kv_layout="NHD",
        use_cuda_graph=False,
        use_tensor_cores=False,
        paged_kv_indptr_buffer=None,
        paged_kv_indices_buffer=None,
        paged_kv_last_page_len_buffer=None,
        backend="auto",
        jit_args=None,
    ):
        self._record("__init__", **{k: v for k, v in locals().items() if k != "self"})

    def plan(
        self,
        indptr,
        indices,
        last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        pos_encoding_mode="NONE",
        window_left=-1,
        logits_soft_cap=None,
        q_data_type="float16",
        kv_data_type=None,
        o_data_type=None,
        data_type=None,
        sm_scale=None,
        rope_scale=None,
        rope_theta=None,
        non_blocking=True,
        block_tables=None,
        seq_lens=None,
        fixed_split_size=None,
        disable_split_kv=False,
        q_len_per_req=1,
    ):
        self._record("plan", **{k: v for k, v in locals().items() if k != "self"})

    def run(
        self,
        q,
        paged_kv_cache,
        *,
        q_scale=None,
        k_scale=None,
        v_scale=None,
        out=None,
        lse=None,
        return_lse=False,
        enable_pdl=None,
        window_left=None,
        sinks=None,
        q_len_per_req=None,
        skip_softmax_threshold_scale_factor=None,
        kv_cache_sf=None,
    ):
        self._record("run", q, paged_kv_cache)
        return torch.zeros_like(q)


@pytest.fixture
def flashinfer_0_6(monkeypatch):
    module = types.ModuleType("flashinfer")
    module.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper  # type: ignore[attr-defined]
    module.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    _Recorder.calls = []
    return _Recorder.calls


def _forward(runner: ModelRunner, chunks: list[ScheduledChunk]) -> None:
    input_ids, positions, batch, _ = runner.build_batch(chunks)
    with torch.inference_mode():
        runner.decoder(input_ids=input_ids, position_ids=positions, use_cache=False, pd_batch=batch)


def test_flashinfer_calls_bind_to_its_0_6_api(flashinfer_0_6, tiny_llama_path, make_engine):
    engine = make_engine(tiny_llama_path)
    config = engine.model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    layers, head_dim = config.num_hidden_layers, config.hidden_size // heads
    backend = FlashInferBackend("cpu")  # the workspace on the CPU: only the kernels are faked
    runner = ModelRunner(engine.model, engine.kv_cache, backend)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(p, params) for p in random_prompts(3, 5, 30, seed=31)]
    engine.step()  # the prompts' KV in the cache (sdpa); their next tokens decode
    requests = [engine.requests[r] for r in rids]

    [init] = [c for c in flashinfer_0_6 if c[1] == "__init__"]
    assert init[2].arguments["kv_layout"] == "NHD"
    assert init[2].arguments["float_workspace_buffer"].numel() == WORKSPACE_BYTES >= 256 * MIB
    flashinfer_0_6.clear()

    _forward(runner, [ScheduledChunk(r, r.num_tokens - 1, 1) for r in requests])  # a decode-only step
    kinds = [(cls, method) for cls, method, _ in flashinfer_0_6]
    decode = "BatchDecodeWithPagedKVCacheWrapper"
    assert kinds == [(decode, "__init__"), (decode, "plan")] + [(decode, "run")] * layers  # planned once per step
    ctor, plan = flashinfer_0_6[0][2].arguments, flashinfer_0_6[1][2].arguments
    assert ctor["kv_layout"] == "NHD" and ctor["use_tensor_cores"] is (heads // kv_heads >= 4)
    assert (plan["num_qo_heads"], plan["num_kv_heads"], plan["head_dim"], plan["page_size"]) == (
        heads,
        kv_heads,
        head_dim,
        engine.config.block_size,
    )
    assert plan["pos_encoding_mode"] == "NONE" and plan["q_data_type"] == plan["kv_data_type"] == torch.float32
    for name in ("indptr", "indices", "last_page_len"):
        assert plan[name].dtype == torch.int32 and plan[name].device.type == "cpu"  # host: plan copies them
    assert plan["indptr"].tolist()[-1] == len(plan["indices"]) and plan["last_page_len"].min() >= 1
    run = flashinfer_0_6[2][2].arguments
    k_cache, v_cache = run["paged_kv_cache"]
    assert k_cache.shape == v_cache.shape == engine.kv_cache.kv[0][0].shape  # [pages, page_size, kv_heads, d]
    assert run["q"].shape == (3, heads, head_dim) and run["q"].is_contiguous()

    flashinfer_0_6.clear()
    engine.block_manager.reset_prefix_cache()
    _forward(runner, [ScheduledChunk(requests[0], 0, requests[0].num_tokens)])  # a prefill step
    prefill = "BatchPrefillWithPagedKVCacheWrapper"
    assert [(c, m) for c, m, _ in flashinfer_0_6] == [(prefill, "plan")] + [(prefill, "run")] * layers
    plan = flashinfer_0_6[0][2].arguments
    assert plan["causal"] is True  # FlashInfer aligns it to the end of each sequence's KV: cached tokens first
    assert plan["qo_indptr"].tolist() == [0, requests[0].num_tokens] and plan["qo_indptr"].dtype == torch.int32
    for rid in rids:
        engine.abort(rid)


def test_flex_compiles_attention_and_block_mask_once_per_process(monkeypatch):
    compiled: list[tuple[object, dict]] = []

    def fake_compile(fn, **options):
        compiled.append((fn, options))
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    flex.compiled_kernels.cache_clear()
    try:
        first, second = flex.FlexBackend("cuda"), flex.FlexBackend("cuda:0")
        assert [fn for fn, _ in compiled] == [flex.flex_attention, flex.create_block_mask]
        assert all(options == {"dynamic": True} for _, options in compiled)
        assert (first._flex, first._block_mask) == (second._flex, second._block_mask)  # one compile, shared
        cpu = flex.FlexBackend("cpu")
        assert len(compiled) == 2 and cpu._block_mask is flex.create_block_mask  # eager on the CPU
    finally:
        flex.compiled_kernels.cache_clear()
