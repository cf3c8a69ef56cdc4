"""The llama.cpp baseline runs the weights pdserve serves: the built-in model's 4-bit GGUF rewritten with every tensor
in F32 holds exactly the values pdserve's own conversion loads; rewritten in BF16, those values rounded as torch rounds
them to bfloat16 (the matrices; norms stay F32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from bench import llama_cpp_baseline
from bench.llama_cpp_baseline import _rewrite, gguf_type, unavailable_reason
from engine.model_loader import smollm2_gguf


@pytest.mark.e2e  # `make test-e2e` (for the suite's 20 minutes): the benchmark's baseline, not what pdserve serves
@pytest.mark.parametrize("kind", ["F32", "BF16"])
def test_the_rewritten_gguf_holds_the_served_weights(smollm2_path, tmp_path, kind):
    import gguf

    out = tmp_path / f"{kind}.gguf"
    _rewrite(smollm2_gguf(), out, kind)
    reader = gguf.GGUFReader(out)
    bf16 = kind == "BF16"
    assert reader.fields["general.file_type"].contents() == (
        gguf.LlamaFileType.MOSTLY_BF16 if bf16 else gguf.LlamaFileType.ALL_F32
    )
    tensors = {t.name: t for t in reader.tensors}
    for tensor in tensors.values():
        matrix = len([d for d in tensor.shape if d > 1]) > 1
        want = gguf.GGMLQuantizationType.BF16 if bf16 and matrix else gguf.GGMLQuantizationType.F32
        assert tensor.tensor_type == want, tensor.name
    served = load_file(smollm2_path / "model.safetensors")
    # names llama.cpp and transformers agree on without a permutation (Q and K are stored permuted for rotary)
    pairs = {
        "token_embd.weight": "model.embed_tokens.weight",
        "blk.3.ffn_down.weight": "model.layers.3.mlp.down_proj.weight",
        "blk.3.ffn_norm.weight": "model.layers.3.post_attention_layernorm.weight",
    }
    for gguf_name, hf_name in pairs.items():
        ours = served[hf_name]
        data = np.array(tensors[gguf_name].data)
        if tensors[gguf_name].tensor_type == gguf.GGMLQuantizationType.BF16:
            theirs = torch.from_numpy(data.view(np.int16)).view(torch.bfloat16).reshape(ours.shape)
            assert torch.equal(theirs, ours.to(torch.bfloat16)), gguf_name
        else:
            assert torch.equal(torch.from_numpy(data).reshape(ours.shape), ours), gguf_name
    assert reader.fields["tokenizer.ggml.tokens"].contents()[:3]  # the tokenizer came along


def test_a_folder_model_has_no_llama_cpp_baseline(tiny_llama_path):
    assert unavailable_reason(str(tiny_llama_path)) is not None


def test_a_dtype_without_a_gguf_type_has_no_llama_cpp_baseline(monkeypatch):
    monkeypatch.setattr(llama_cpp_baseline.importlib.util, "find_spec", lambda name: object())  # as if installed
    assert gguf_type("bfloat16") == "BF16" and gguf_type("float32") == "F32" and gguf_type("float16") is None
    assert "no GGUF in float16" in str(unavailable_reason("smollm2-135m-instruct", "float16"))
    assert unavailable_reason("smollm2-135m-instruct", "bfloat16") is None
