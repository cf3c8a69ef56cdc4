"""A tensor-parallel rank's shard of a model: what to cut comes from the model's own plans (transformers'
``base_model_tp_plan``, and ``base_model_ep_plan`` at an expert degree above 1: ``engine.expert_parallel``), and each
rank reads only its slices from the safetensors files.

``colwise`` linears (q/k/v by heads, gate/up in slices of the MLP) keep their part of the output, ``rowwise`` ones (o,
down) their part of the input and end in one all-reduce (``RowParallel``); ``replicated`` entries and everything the
plan does not name (norms, the embedding, the lm_head, a mixture's experts where its plan leaves them) are whole on
every rank. Experts stored one by one and fused in the model (Mixtral's, Qwen3-MoE's) are fused here as transformers
does at load, from this rank's experts only. A plan entry of another style, or a checkpoint conversion of another kind,
is a refusal naming it (``tp_plan``). The group, the step messages and the followers: ``engine.tensor_parallel``.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from engine.blocks import kv_shape_from_config, routed_experts
from engine.expert_parallel import ExpertParallel, ExpertSplit, ExpertTraffic, ep_plan, expert_plan
from engine.tensor_parallel import HeadSplit, RowParallel, TPGroup, head_split

CUT_STYLES = ("colwise", "rowwise")
# whole on every rank (in training their gradients are all-reduced): per-head norms, and latent attention's down
# projection to the latent row, which every rank caches whole (the one KV "head" that all its q heads read)
REPLICATED_STYLES = ("replicated_with_grad_allreduce", "mla_kv_a_proj")
HEAD_CUTS = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise"}
# latent attention (DeepSeek): the query (q_proj, or q_b_proj after a low-rank q_a_proj) and the latent's up
# projection kv_b_proj by heads, o_proj by rows
LATENT_HEAD_CUTS = {"kv_b_proj": "colwise", "o_proj": "rowwise"}
PER_Q_HEAD = ("q_proj", "q_b_proj", "kv_b_proj", "o_proj")  # widths cut in runs of the rank's query heads
MLP_WIDTHS = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")  # cut in slices of intermediate_size
# fused projections and their parts, in order (Phi-3's qkv_proj, Phi-3's and GLM-4's gate_up_proj). transformers'
# plans gather such an output whole (``colwise_gather_output``) and split the next layer's input again
# (``rowwise_split_input``); here each rank keeps its heads' or its slice's share of every part, side by side, which
# is the same shard with no gather, so those two styles run as colwise and rowwise on these layers
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
GATHERED_STYLES = {"colwise_gather_output": "colwise", "rowwise_split_input": "rowwise"}


def tp_plan(hf_config: Any, size: int) -> dict[str, str]:
    """The model's tensor-parallel plan (module pattern -> style), or a ValueError naming ``tensor_parallel_size``,
    the model type and the entry pdserve cannot run: a style other than colwise, rowwise or replicated (fused
    projections split by their parts, latent attention's, experts'), or a plan that does not cut the attention by
    heads (each rank's KV cache holds its heads)."""
    plan = {pattern: _shard_style(pattern, style) for pattern, style in _model_plan(hf_config).items()}
    where = f"tensor_parallel_size {size}: model type {hf_config.model_type!r}"
    instead = "serve it on one rank"
    if expert_plan(hf_config):
        instead += ", or split its experts alone (tensor_parallel_size 1, expert_parallel_size N)"
    for pattern, style in plan.items():
        if style not in CUT_STYLES + REPLICATED_STYLES:
            raise ValueError(
                f"{where}: its tensor-parallel plan's entry {pattern!r}: {style!r} is not a cut pdserve runs "
                f"({', '.join(CUT_STYLES + REPLICATED_STYLES)}); {instead}"
            )
    checkpoint_layout(hf_config.model_type, where)  # a conversion pdserve cannot do is refused here
    attention = {p.rsplit(".", 1)[-1]: style for p, style in plan.items() if ".self_attn." in p}
    if "kv_b_proj" in attention:  # latent attention: the query by heads, whichever projection ends in them
        q_leaf = "q_b_proj" if getattr(hf_config, "q_lora_rank", None) else "q_proj"
        cuts, named = LATENT_HEAD_CUTS | {q_leaf: "colwise"}, f"{q_leaf} and kv_b_proj"
    elif "qkv_proj" in attention:  # one fused projection, cut by the heads of each of its parts
        cuts, named = {"qkv_proj": "colwise", "o_proj": "rowwise"}, "qkv_proj's q, k and v"
    else:
        cuts, named = HEAD_CUTS, "q_proj, k_proj and v_proj"
    if any(attention.get(name) != style for name, style in cuts.items()):
        raise ValueError(
            f"{where}: its tensor-parallel plan does not cut {named} by heads and o_proj by rows "
            f"({plan or 'the config has no plan'}); {instead}"
        )
    return plan


def _model_plan(hf_config: Any) -> dict[str, str]:
    return dict(getattr(hf_config, "base_model_tp_plan", None) or {})


def _shard_style(pattern: str, style: str) -> str:
    """The style pdserve runs for a plan entry: a gathered one on a fused projection, or the split input after it,
    as its plain cut (``FUSED_PARTS``); any other entry as it is."""
    leaf = pattern.rsplit(".", 1)[-1]
    if style == "colwise_gather_output" and leaf in FUSED_PARTS:
        return "colwise"
    if style == "rowwise_split_input":
        return "rowwise"  # its input is the fused projection's local share, never a gathered one (refused above)
    return style


def cache_kv_heads(hf_config: Any) -> int:
    """The KV heads the engine caches (one latent row for latent attention), as its probe finds them."""
    return kv_shape_from_config(hf_config.to_dict())[1]


@dataclass(frozen=True, slots=True)
class ExpertFusion:
    """Experts stored one by one and fused in the model (transformers' ``WeightConverter`` of ``MergeModulelist(dim=0)``
    then ``Concatenate(dim=1)``): each source's experts stacked on the expert axis, the sources (gate, up) concatenated
    on dim 1 into ``target``."""

    sources: tuple[re.Pattern[str], ...]  # group 1: the name's prefix, group 2: the expert's index
    target: str


@dataclass(frozen=True, slots=True)
class CheckpointLayout:
    """How a model type's stored names become the model's (transformers' conversion mapping): renames, then fusions."""

    renames: tuple[tuple[re.Pattern[str], str], ...] = ()
    fusions: tuple[ExpertFusion, ...] = ()

    def rename(self, name: str) -> str:
        for pattern, replacement in self.renames:
            name = pattern.sub(replacement, name)
        return name

    def fused(self, name: str) -> tuple[str, int, int] | None:
        """(the model's weight, which source, which expert) for a stored expert's weight, None for any other."""
        for fusion in self.fusions:
            for index, pattern in enumerate(fusion.sources):
                hit = pattern.match(name)
                if hit:
                    return hit.group(1) + fusion.target, index, int(hit.group(2))
        return None


def checkpoint_layout(model_type: str, where: str = "") -> CheckpointLayout:
    """The renames and expert fusions transformers applies to this model type's checkpoint at load; ValueError
    naming the conversion when it is of another kind."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # a transformers without them
        return CheckpointLayout()
    renames: list[tuple[re.Pattern[str], str]] = []
    fusions: list[ExpertFusion] = []
    for conversion in get_checkpoint_conversion_mapping(model_type) or []:
        kind = type(conversion).__name__
        sources, targets = list(conversion.source_patterns), list(conversion.target_patterns)
        operations = [(type(op).__name__, getattr(op, "dim", None)) for op in getattr(conversion, "operations", [])]
        if kind == "WeightRenaming" and len(sources) == len(targets) == 1:
            renames.append((re.compile(sources[0]), targets[0]))
            continue
        fused = [("MergeModulelist", 0)] + ([("Concatenate", 1)] if len(sources) > 1 else [])
        if kind == "WeightConverter" and len(targets) == 1 and operations == fused and all("*" in p for p in sources):
            patterns = tuple(re.compile("^(.*?)" + re.escape(p).replace(r"\*", r"(\d+)") + "$") for p in sources)
            fusions.append(ExpertFusion(patterns, targets[0]))
            continue
        raise ValueError(
            f"{where or f'model type {model_type!r}'}: transformers converts its checkpoint at load ({kind} "
            f"{sources} -> {targets}, {operations}), which pdserve's shard loader does not; serve it on one rank"
        )
    return CheckpointLayout(tuple(renames), tuple(fusions))


def check_degree(hf_config: Any, size: int, expert_size: int = 1) -> None:
    """ValueError naming ``tensor_parallel_size`` when the model cannot be split ``size`` ways, or
    ``expert_parallel_size`` when its experts cannot be split ``expert_size`` ways over those ranks."""
    ep_plan(hf_config, size, expert_size)
    if size == 1:
        return
    plan = tp_plan(hf_config, size)
    head_split(hf_config.num_attention_heads, cache_kv_heads(hf_config), size, 0)
    cuts_mlp = any(p.rsplit(".", 1)[-1] in MLP_WIDTHS for p in plan)
    if cuts_mlp and hf_config.intermediate_size % size:
        raise ValueError(
            f"tensor_parallel_size {size} does not divide the model's intermediate_size {hf_config.intermediate_size}"
        )


Spans = tuple[tuple[int, int], ...]  # [start, stop) ranges of a cut dimension, kept side by side


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """Which slice of each split weight this rank keeps, by its full name (``model.layers.0.self_attn.q_proj.weight``):
    (dim, spans); a weight not named is replicated. Row-parallel biases stay on rank 0 only, so the sum adds
    them once. ``rowwise``: the modules whose outputs are summed over the ranks."""

    slices: dict[str, tuple[int, Spans]]
    zero_bias: frozenset[str]
    rowwise: tuple[str, ...]

    def cut(self, name: str, tensor: Any) -> torch.Tensor:
        """This rank's part of the weight ``name`` (a tensor or a safetensors slice): its spans of the cut dimension
        side by side (one per part of a fused projection); a full weight is read whole."""
        if name in self.zero_bias:
            return torch.zeros_like(tensor[:])
        where = self.slices.get(name)
        if where is None:
            return tensor[:]
        dim, spans = where
        parts = [tensor[start:stop] if dim == 0 else tensor[:, start:stop] for start, stop in spans]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _spans(leaf: str, width: int, hf_config: Any, split: HeadSplit) -> Spans:
    """This rank's spans of a cut dimension of ``width``: one, or one per part of a fused projection (its q, k and v
    heads; its gate and up slices), each at its part's offset."""
    parts = FUSED_PARTS.get(leaf)
    if parts is None:
        return (_span(leaf, width, hf_config, split),)
    if leaf == "qkv_proj":
        head_dim = width // (hf_config.num_attention_heads + 2 * hf_config.num_key_value_heads)
        widths = [hf_config.num_attention_heads * head_dim] + [hf_config.num_key_value_heads * head_dim] * 2
    else:
        widths = [width // len(parts)] * len(parts)
    spans, offset = [], 0
    for part, part_width in zip(parts, widths, strict=True):
        start, stop = _span(part, part_width, hf_config, split)
        spans.append((offset + start, offset + stop))
        offset += part_width
    return tuple(spans)


def _span(leaf: str, width: int, hf_config: Any, split: HeadSplit) -> tuple[int, int]:
    """This rank's part of a cut dimension of ``width``: its q heads (q, o), its KV heads (k, v), else 1/N."""
    if leaf in PER_Q_HEAD:
        per_head = width // hf_config.num_attention_heads
        return split.q_start * per_head, (split.q_start + split.q_heads) * per_head
    if leaf in ("k_proj", "v_proj"):
        per_head = width // hf_config.num_key_value_heads
        return split.kv_start * per_head, (split.kv_start + split.kv_heads) * per_head
    if width % split.size:
        raise ValueError(f"tensor_parallel_size {split.size} does not divide {leaf}'s {width} features")
    per_rank = width // split.size
    return split.rank * per_rank, (split.rank + 1) * per_rank


def _plan_patterns(plan: dict[str, str]) -> list[tuple[re.Pattern[str], str]]:
    """A plan's module patterns (``*``: a layer index) as regular expressions, with their styles."""
    return [(re.compile(re.escape(p).replace(r"\*", r"\d+") + "$"), style) for p, style in plan.items()]


def shard_plan(model: torch.nn.Module, hf_config: Any, split: HeadSplit, plan: dict[str, str]) -> ShardPlan:
    """The slices of every linear the model's plan cuts, found by matching its patterns (``*``: a layer index) against
    the decoder's module names."""
    prefix = str(cast(Any, model).base_model_prefix)
    patterns = _plan_patterns(plan)
    slices: dict[str, tuple[int, Spans]] = {}
    zero_bias: set[str] = set()
    rowwise: list[str] = []
    for name, module in getattr(model, prefix).named_modules():
        style = next((style for pattern, style in patterns if pattern.match(name)), None)
        if style not in CUT_STYLES:
            continue
        if not isinstance(module, torch.nn.Linear):
            raise ValueError(f"model type {hf_config.model_type!r}: the plan cuts {name}, which is not a linear layer")
        full, leaf = f"{prefix}.{name}", name.rsplit(".", 1)[-1]
        if style == "colwise":
            slices[f"{full}.weight"] = slices[f"{full}.bias"] = (0, _spans(leaf, module.out_features, hf_config, split))
        else:
            slices[f"{full}.weight"] = (1, _spans(leaf, module.in_features, hf_config, split))
            if split.rank:
                zero_bias.add(f"{full}.bias")
            rowwise.append(full)
    return ShardPlan(slices, frozenset(zero_bias), tuple(rowwise))


def _cut_linear(linear: torch.nn.Linear, name: str, plan: ShardPlan) -> None:
    linear.weight = torch.nn.Parameter(plan.cut(f"{name}.weight", linear.weight.data).clone(), requires_grad=False)
    linear.out_features, linear.in_features = linear.weight.shape
    if linear.bias is not None:
        linear.bias = torch.nn.Parameter(plan.cut(f"{name}.bias", linear.bias.data).clone(), requires_grad=False)


def _fused_attention_heads(model: torch.nn.Module, plan: ShardPlan, split: HeadSplit) -> None:
    """A fused q/k/v projection's forward finds its parts by the head counts in its module and its config (Phi-3's
    ``query_pos``): each attention module whose ``qkv_proj`` the plan cut gets its rank's counts, in a config of its
    own (the model's, shallow-copied; the model's own config keeps the whole model's)."""
    for name, module in model.named_modules():
        if f"{name}.qkv_proj.weight" not in plan.slices:
            continue
        local = copy.copy(cast(Any, module).config)
        local.num_attention_heads, local.num_key_value_heads = split.q_heads, split.kv_heads
        cast(Any, module).config = local
        for attribute, value in (("num_heads", split.q_heads), ("num_key_value_heads", split.kv_heads)):
            if hasattr(module, attribute):
                setattr(module, attribute, value)


def expert_shard(model: torch.nn.Module, split: ExpertSplit, plan: dict[str, str]) -> dict[str, list[str]]:
    """Each ``ep_dispatch_experts`` module of the expert plan (its full name) with its ``grouped_gemm`` weights, cut
    here on the meta device to the rank's experts (the module's ``num_experts`` then counts its own)."""
    prefix = str(cast(Any, model).base_model_prefix)
    patterns = _plan_patterns(plan)
    styles = {
        f"{prefix}.{name}": style
        for name, _ in [*getattr(model, prefix).named_modules(), *getattr(model, prefix).named_parameters()]
        for pattern, style in patterns
        if pattern.match(name)
    }
    shard: dict[str, list[str]] = {}
    for name, style in styles.items():
        if style != "ep_dispatch_experts":
            continue
        module = model.get_submodule(name)
        weights = [leaf for leaf, _ in module.named_parameters(recurse=False) if styles.get(f"{name}.{leaf}")]
        for leaf in weights:
            whole = module._parameters[leaf]
            assert whole is not None and whole.shape[0] == split.total  # one row per routed expert
            local = torch.empty(split.count, *whole.shape[1:], dtype=whole.dtype, device="meta")
            module._parameters[leaf] = torch.nn.Parameter(local, requires_grad=False)
        cast(Any, module).num_experts = split.count
        cast(Any, module)._is_expert_parallel = True  # transformers' experts skip the masked id (num_experts)
        shard[name] = weights
    return shard


def load_shard(
    path: Path,
    dtype: torch.dtype,
    device: torch.device,
    attn_implementation: str,
    group: TPGroup,
    tensor_size: int,
    expert_size: int = 1,
) -> Any:
    """This rank's shard of the model at ``path`` (its layers cut ``tensor_size`` ways, its experts ``expert_size``
    ways, over the group's ranks): built on the meta device, cut to the rank's shapes, then filled from the
    safetensors files slice by slice, so no rank ever holds a whole split weight (nor, at an expert degree above 1,
    another rank's experts). At tensor degree 1 every rank holds the attention whole."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    check_degree(config, tensor_size, expert_size)
    split = head_split(config.num_attention_heads, cache_kv_heads(config), group.size, group.rank, tensor_size)
    total_experts = routed_experts(config.to_dict())
    experts = ExpertSplit(group.rank, expert_size, total_experts) if expert_size > 1 else None
    layout = checkpoint_layout(config.model_type)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    plan = shard_plan(model, config, split, tp_plan(config, tensor_size) if tensor_size > 1 else {})
    expert_modules = expert_shard(model, experts, ep_plan(config, tensor_size, expert_size)) if experts else {}
    expert_weights = {f"{name}.{leaf}" for name, leaves in expert_modules.items() for leaf in leaves}
    with torch.no_grad():
        for name in plan.slices.keys() - plan.zero_bias:
            if name.endswith(".weight"):
                module_name = name.removesuffix(".weight")
                _cut_linear(model.get_submodule(module_name), module_name, plan)  # meta shapes, no data
    _fused_attention_heads(model, plan, split)
    index = path / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    )
    state: dict[str, torch.Tensor] = {}
    stored_experts: dict[str, dict[int, dict[int, torch.Tensor]]] = {}  # fused weight -> source -> expert -> tensor
    first, last = (experts.start, experts.start + experts.count) if experts else (0, total_experts)
    for file in files:
        with safe_open(str(path / file), framework="pt", device=str(device)) as f:
            for stored in f.keys():
                name = layout.rename(stored)
                fused = layout.fused(name)
                if fused is not None:
                    target, source, expert = fused
                    if first <= expert < last:
                        sources = stored_experts.setdefault(target, {})
                        sources.setdefault(source, {})[expert - first] = f.get_tensor(stored)
                    continue
                tensor = f.get_slice(stored)
                if name in expert_weights and experts is not None:
                    tensor = tensor[experts.start : experts.start + experts.count]
                else:
                    tensor = plan.cut(name, tensor)
                state[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    for target, sources in stored_experts.items():  # stacked on the expert axis, then gate and up side by side
        stacked = [torch.stack([by_expert[e] for e in sorted(by_expert)]) for _, by_expert in sorted(sources.items())]
        state[target] = torch.cat(stacked, dim=1).to(dtype)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
        missing = [m for m in missing if not m.startswith("lm_head.")]
    if missing or unexpected:
        raise ValueError(f"model: {path}: weights missing {missing[:3]} or not in the model {unexpected[:3]}")
    _init_buffers(model, device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"model: {path}: {len(left)} tensors were not loaded, e.g. {left[0]}")
    for name in plan.rowwise:
        parent, _, leaf = name.rpartition(".")
        holder = model.get_submodule(parent)
        setattr(holder, leaf, RowParallel(getattr(holder, leaf), group))
    if experts is not None:
        traffic = ExpertTraffic(expert_size, moe_layers=len(expert_modules))
        for name in expert_modules:
            parent, _, leaf = name.rpartition(".")
            holder = model.get_submodule(parent)
            setattr(holder, leaf, ExpertParallel(getattr(holder, leaf), experts, group, traffic))
    model.eval()
    return model


def _init_buffers(model: Any, device: torch.device) -> None:
    """Non-persistent buffers are not in the files (rotary ``inv_freq``, Gemma's ``embed_scale``): made on the device
    and set by the model's own ``_init_weights``, as transformers does after a meta-device load; the loaded weights
    are marked initialized, so it leaves them as they are."""
    for parameter in model.parameters():
        parameter._is_hf_initialized = True
    owners = []
    for module in model.modules():
        meta = [name for name, buffer in module.named_buffers(recurse=False) if buffer.is_meta]
        for name in meta:
            module._buffers[name] = torch.empty_like(module._buffers[name], device=device)
        if meta:
            owners.append(module)
    with torch.no_grad():
        for module in owners:
            model._init_weights(module)
