"""The llama.cpp baseline runs the weights pdserve serves: the built-in model's 4-bit GGUF rewritten with every tensor
in F32 holds exactly the values pdserve's own conversion loads."""

from __future__ import annotations

import numpy as np
import torch
from safetensors.torch import load_file

from bench.llama_cpp_baseline import _rewrite_f32, unavailable_reason
from engine.model_loader import smollm2_gguf


def test_the_f32_gguf_holds_the_served_weights(smollm2_path, tmp_path):
    import gguf

    out = tmp_path / "f32.gguf"
    _rewrite_f32(smollm2_gguf(), out)
    reader = gguf.GGUFReader(out)
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType.ALL_F32
    tensors = {t.name: t for t in reader.tensors}
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in tensors.values())
    served = load_file(smollm2_path / "model.safetensors")
    # names llama.cpp and transformers agree on without a permutation (Q and K are stored permuted for rotary)
    pairs = {
        "token_embd.weight": "model.embed_tokens.weight",
        "blk.3.ffn_down.weight": "model.layers.3.mlp.down_proj.weight",
    }
    for gguf_name, hf_name in pairs.items():
        ours = served[hf_name]
        theirs = torch.from_numpy(np.array(tensors[gguf_name].data)).reshape(ours.shape)
        assert torch.equal(theirs, ours), gguf_name
    assert reader.fields["tokenizer.ggml.tokens"].contents()[:3]  # the tokenizer came along


def test_a_folder_model_has_no_llama_cpp_baseline(tiny_llama_path):
    assert unavailable_reason(str(tiny_llama_path)) is not None
