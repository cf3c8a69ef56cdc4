"""The KV hand-off between tensor-parallel engines of any two degrees: a prefill engine at degree p exports every KV
head (gathered on its rank 0), a decode engine at degree d imports it (each rank keeps its heads), over gloo on the CPU.

Checked for (p, d) in (1, 2), (2, 1), (2, 2) and (4, 2) on a model with 2 KV heads (4 ranks replicate them):
- the prefill ranks' KV reassembled, the KV that left, and the decode ranks' KV reassembled are bit-identical over the
  prompt's tokens;
- the decode engine then generates the tokens one engine at degree 1 generates alone (greedy; the chosen tokens'
  logprobs within 1e-4, the gap printed: the ranks' all-reduce sums in another order);
- every engine ends with no request and no block held (``check_no_leaks``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from engine.tensor_parallel import HeadSplit
from engine.tp_launch import run_ranks

LOGPROB_TOLERANCE = 1e-4
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a quiet village,"]
MAX_TOKENS = 8


def _config(model: str, size: int):
    from engine.config import EngineConfig

    return EngineConfig(
        model=model, dtype="float32", kv_blocks=64, block_size=4, max_batch_tokens=16, tensor_parallel_size=size
    )


def _params():
    from engine.request import SamplingParams

    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0, ignore_eos=True)


def _follower(rank: int, size: int, store_path: str, model: str) -> dict:
    import torch.distributed as dist

    from engine.engine_parts import build_engine_parts
    from engine.tensor_parallel import StepChannel, TPFollower, TPGroup

    group = TPGroup(dist.FileStore(store_path, size), rank, size, 60.0)
    parts = build_engine_parts(_config(model, size), group)
    ended = TPFollower(parts.runner, StepChannel(group)).serve()
    group.close()
    return {
        "ended": ended,
        "cache": torch.stack(parts.kv_cache.kv),
        "split": dataclasses.astuple(parts.runner.head_split),
    }  # [layers, 2, blocks + 1, bs, heads, hd]


def _engine(rank: int, size: int, store_path: str, model: str):
    import torch.distributed as dist

    from engine.llm_engine import LLMEngine
    from engine.tensor_parallel import TPGroup

    group = TPGroup(dist.FileStore(store_path, size), rank, size, 60.0) if size > 1 else None
    return LLMEngine(_config(model, size), group)


def _finish(engine, out: dict) -> dict:
    engine.check_no_leaks()
    engine.close()  # stops the followers
    return out | {"cache": torch.stack(engine.kv_cache.kv), "split": dataclasses.astuple(engine.runner.head_split)}


def _prefill_main(rank: int, size: int, store_path: str, model: str) -> dict:
    """Prefill-only requests whose streamed KV is collected per layer (every head), then released."""
    torch.set_num_threads(1)
    if rank > 0:
        return _follower(rank, size, store_path, model)
    engine = _engine(rank, size, store_path, model)
    exported: dict[str, dict[int, list]] = {}  # per request, per layer: its pieces, in block order as they came
    blocks: dict[str, list[int]] = {}
    first_tokens: dict[str, int] = {}

    def sink(ready) -> None:
        exported.setdefault(ready.request_id, {}).setdefault(ready.layer, []).append(torch.stack((ready.k, ready.v)))

    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, _params(), f"r{i}", prefill_only=True, kv_sink=sink, stream_kv=False)
    while engine.has_unfinished():
        for output in engine.step():
            assert output.error is None, output.error
            first_tokens[output.request_id] = output.new_token_ids[0]
            blocks[output.request_id] = list(engine.requests[output.request_id].block_ids)
            engine.release(output.request_id)
    # per request, per layer: [2, blocks, bs, every head, hd]
    kv = {
        rid: {layer: torch.cat(pieces, dim=1) for layer, pieces in layers.items()} for rid, layers in exported.items()
    }
    prompts = {f"r{i}": engine.tokenize(p) for i, p in enumerate(PROMPTS)}
    return _finish(engine, {"kv": kv, "blocks": blocks, "first_tokens": first_tokens, "prompts": prompts})


def _decode_main(rank: int, size: int, store_path: str, payload: tuple[str, dict]) -> dict:
    """Reservations whose KV and first token come from the prefill run, decoded to the end."""
    model, prefilled = payload
    torch.set_num_threads(1)
    if rank > 0:
        return _follower(rank, size, store_path, model)
    engine = _engine(rank, size, store_path, model)
    blocks: dict[str, list[int]] = {}
    for rid, prompt in prefilled["prompts"].items():
        reserved = engine.kv_importer.reserve(prompt, _params(), rid)
        assert reserved is not None
        blocks[rid] = reserved
        missing = engine.kv_importer.expected_blocks(engine.requests[rid])
        for layer, kv in prefilled["kv"][rid].items():
            engine.kv_importer.write(rid, layer, missing, kv[0], kv[1])
        assert engine.kv_importer.kv_done(rid)
        engine.kv_importer.tokens_in(rid, [prefilled["first_tokens"][rid]])
    tokens: dict[str, list[int]] = {rid: [t] for rid, t in prefilled["first_tokens"].items()}
    logprobs: dict[str, list[float]] = {rid: [] for rid in tokens}
    while engine.has_unfinished():
        for output in engine.step():
            assert output.error is None, output.error
            tokens[output.request_id] += output.new_token_ids
            logprobs[output.request_id] += [lp.logprob for lp in output.logprobs or []]
    return _finish(engine, {"tokens": tokens, "logprobs": logprobs, "blocks": blocks})


def _alone_main(rank: int, size: int, store_path: str, model: str) -> dict:
    torch.set_num_threads(1)
    engine = _engine(0, 1, store_path, model)
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, _params(), f"r{i}")
    while engine.has_unfinished():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            logprobs.setdefault(output.request_id, []).extend(lp.logprob for lp in output.logprobs or [])
    return _finish(engine, {"tokens": tokens, "logprobs": logprobs})


def _reassembled(ranks: dict[int, dict], block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """Every head of ``block_ids``' first ``num_tokens`` slots, from each rank's cache: [layers, 2, tokens, heads, hd]."""
    parts = [ranks[r]["cache"][:, :, block_ids] for r in range(len(ranks))]
    return HeadSplit(*ranks[0]["split"]).whole_kv(parts).flatten(2, 3)[:, :, :num_tokens]


@pytest.fixture(scope="module")
def alone(tiny_llama_path: Path) -> dict:
    return run_ranks(_alone_main, 1, str(tiny_llama_path))[0]


@pytest.mark.parametrize(
    ("prefill_degree", "decode_degree"),
    # (1, 2) in `make test`; the other crossings in `make test-e2e` (for the suite's 20 minutes)
    [(1, 2), *(pytest.param(p, d, marks=pytest.mark.e2e) for p, d in ((2, 1), (2, 2), (4, 2)))],
)
def test_kv_crosses_degrees_bit_identical_and_decodes_as_one_engine(
    tiny_llama_path: Path, alone: dict, prefill_degree: int, decode_degree: int
):
    prefill = run_ranks(_prefill_main, prefill_degree, str(tiny_llama_path), timeout_s=240)
    assert all(prefill[r]["ended"] == "stop" for r in range(1, prefill_degree))
    sent = prefill[0]
    decode = run_ranks(_decode_main, decode_degree, (str(tiny_llama_path), sent), timeout_s=240)
    assert all(decode[r]["ended"] == "stop" for r in range(1, decode_degree))
    for rid, prompt in sent["prompts"].items():
        n = len(prompt)
        crossed = torch.stack([sent["kv"][rid][layer] for layer in sorted(sent["kv"][rid])]).flatten(2, 3)[:, :, :n]
        assert crossed.shape[-2] == 2  # every KV head of the model left, whatever the degree
        assert torch.equal(_reassembled(prefill, sent["blocks"][rid], n), crossed), rid
        assert torch.equal(_reassembled(decode, decode[0]["blocks"][rid], n), crossed), rid
    got = decode[0]
    assert got["tokens"] == alone["tokens"]
    gap = max(
        abs(a - b)
        for rid in got["logprobs"]
        for a, b in zip(got["logprobs"][rid], alone["logprobs"][rid][1:], strict=True)
    )
    print(f"({prefill_degree}, {decode_degree}): largest logprob gap against one engine alone: {gap:.2e}")
    assert gap < LOGPROB_TOLERANCE


# ---- a move between tensor-parallel decode engines: the same hand-off with a decoding source --------------------

MOVE_PROMPT = "r0"  # PROMPTS[0], decoded by the source until it has MOVED_AFTER tokens, then by the target
PRECOPY_AFTER, MOVED_AFTER = 2, 4  # output tokens when the pre-copy is read, and when the source stops it


def _move_source_main(rank: int, size: int, store_path: str, model: str) -> dict:
    """A decoding request on a degree-``size`` engine: its full blocks exported while it decodes on, then it is
    frozen and the rest exported (every head, gathered from the ranks between steps: ``StepKind.KV_READ``)."""
    torch.set_num_threads(1)
    if rank > 0:
        return _follower(rank, size, store_path, model)
    engine = _engine(rank, size, store_path, model)
    pieces: dict[int, list] = {}  # per layer: [2, blocks, bs, every head, hd] pieces, in block order

    def sink(ready) -> None:
        pieces.setdefault(ready.layer, []).append(torch.stack((ready.k, ready.v)))

    engine.add_request(PROMPTS[0], _params(), MOVE_PROMPT)
    tokens, logprobs = [], []

    def step_until(count: int) -> None:
        while len(tokens) < count:
            for output in engine.step():
                tokens.extend(output.new_token_ids)
                logprobs.extend(lp.logprob for lp in output.logprobs or [])

    step_until(PRECOPY_AFTER)
    request = engine.requests[MOVE_PROMPT]
    layers, size_ = range(engine.kv_spec.num_layers), engine.config.block_size
    context_at_reserve, precopy = request.num_computed_tokens, request.num_computed_tokens // size_
    engine.kv_exporter.export_held(request, sink, 0, precopy, layers)
    step_until(MOVED_AFTER)
    frozen = engine.freeze(MOVE_PROMPT)
    end = -(-request.num_computed_tokens // size_)
    engine.kv_exporter.export_held(request, sink, precopy, end, layers)
    engine.release(MOVE_PROMPT)
    kv = {layer: torch.cat(parts, dim=1) for layer, parts in pieces.items()}
    out = {"tokens": tokens, "frozen": frozen, "logprobs": logprobs, "kv": kv, "end": end}
    out |= {"context_at_reserve": context_at_reserve, "prompt": engine.tokenize(PROMPTS[0])}
    return _finish(engine, out)


def _move_target_main(rank: int, size: int, store_path: str, payload: tuple[str, dict]) -> dict:
    """The move's target at degree ``size``: reserves the context, takes the KV (each rank keeps its heads) and the
    tokens, and decodes the rest."""
    model, moved = payload
    torch.set_num_threads(1)
    if rank > 0:
        return _follower(rank, size, store_path, model)
    engine = _engine(rank, size, store_path, model)
    rid = MOVE_PROMPT + ".1"
    blocks = engine.kv_importer.reserve(moved["prompt"], _params(), rid, context_tokens=moved["context_at_reserve"])
    assert blocks is not None
    for layer, kv in moved["kv"].items():
        engine.kv_importer.write(rid, layer, blocks[: moved["end"]], kv[0], kv[1])
    engine.kv_importer.tokens_in(rid, moved["frozen"])
    assert engine.kv_importer.kv_done(rid, moved["end"])
    tokens, logprobs = [], []
    while engine.has_unfinished():
        for output in engine.step():
            assert output.error is None, output.error
            tokens += output.new_token_ids
            logprobs += [lp.logprob for lp in output.logprobs or []]
    return _finish(engine, {"tokens": tokens, "logprobs": logprobs, "blocks": blocks[: moved["end"]]})


@pytest.mark.parametrize(
    ("source_degree", "target_degree"),
    # (2, 1) in `make test`; (2, 2) in `make test-e2e` (for the suite's 20 minutes)
    [(2, 1), pytest.param(2, 2, marks=pytest.mark.e2e)],
)
def test_a_request_on_a_tensor_parallel_engine_moves_token_exact(
    tiny_llama_path: Path, alone: dict, source_degree: int, target_degree: int
):
    source = run_ranks(_move_source_main, source_degree, str(tiny_llama_path), timeout_s=240)
    moved = source[0]
    assert moved["frozen"] == moved["tokens"] and len(moved["tokens"]) == MOVED_AFTER
    n = len(moved["prompt"]) + MOVED_AFTER - 1  # the KV that crossed: every token but the last one
    crossed = torch.stack([moved["kv"][layer] for layer in sorted(moved["kv"])]).flatten(2, 3)[:, :, :n]
    assert crossed.shape[-2] == 2  # every KV head of the model left, gathered from both ranks
    target = run_ranks(_move_target_main, target_degree, (str(tiny_llama_path), moved), timeout_s=240)
    assert all(target[r]["ended"] == "stop" for r in range(1, target_degree))
    assert torch.equal(_reassembled(target, target[0]["blocks"], n), crossed)  # each rank kept its heads, exactly
    tokens = moved["tokens"] + target[0]["tokens"]
    assert tokens == alone["tokens"][MOVE_PROMPT]  # the stream one engine alone gives, token for token
    logprobs = moved["logprobs"] + target[0]["logprobs"]
    gap = max(abs(a - b) for a, b in zip(logprobs, alone["logprobs"][MOVE_PROMPT], strict=True))
    print(f"move ({source_degree} -> {target_degree}): largest logprob gap against one engine alone: {gap:.2e}")
    assert gap < LOGPROB_TOLERANCE
