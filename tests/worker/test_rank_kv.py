"""Hand-offs between tensor-parallel workers of any two degrees, each rank sending and taking its own heads
(worker/rank_kv.py), over gloo step channels and the zmq KV plane on loopback, every rank its own process.

Checked for (p, d) in (1, 2), (2, 1), (2, 2) and (4, 2) on a model with 2 KV heads (4 ranks replicate them):
- the parts: which sender rank sends which heads to which receiver rank, a replicated head sent once;
- the prefill ranks' KV reassembled and the decode ranks' KV reassembled are bit-identical over the prompt's tokens;
- the decode worker then generates the tokens one engine at degree 1 generates alone (greedy; the chosen tokens'
  logprobs within 1e-4, the gap printed: the ranks' all-reduce sums in another order);
- a move between decode workers of degrees (2, 1) and (2, 2): its pre-copy and its rest cross rank to rank, token-exact;
- every engine ends with no request and no block held, every endpoint with no transfer pending.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.tensor_parallel import HandoffPart, HeadSplit, handoff_parts
from engine.tp_launch import run_ranks

LOGPROB_TOLERANCE = 1e-4
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a quiet village,"]
MAX_TOKENS = 8
WAIT_S = 120.0


# ---- the parts ---------------------------------------------------------------------------------------------------


def test_each_receiver_rank_gets_each_of_its_heads_from_one_sender_rank():
    assert handoff_parts(4, 2, 1, 1) == [HandoffPart(0, 0, 0, 0, 2)]
    assert handoff_parts(4, 2, 1, 2) == [HandoffPart(0, 0, 0, 0, 1), HandoffPart(0, 1, 1, 0, 1)]
    assert handoff_parts(4, 2, 2, 1) == [HandoffPart(0, 0, 0, 0, 1), HandoffPart(1, 0, 0, 1, 1)]
    assert handoff_parts(4, 2, 2, 2) == [HandoffPart(0, 0, 0, 0, 1), HandoffPart(1, 1, 0, 0, 1)]
    # 4 ranks hold 2 heads twice each: a head goes once to each receiver rank, from the first rank holding it
    assert handoff_parts(4, 2, 4, 2) == [HandoffPart(0, 0, 0, 0, 1), HandoffPart(2, 1, 0, 0, 1)]
    assert handoff_parts(4, 2, 2, 4) == [
        HandoffPart(0, 0, 0, 0, 1),
        HandoffPart(0, 1, 0, 0, 1),
        HandoffPart(1, 2, 0, 0, 1),
        HandoffPart(1, 3, 0, 0, 1),
    ]
    # runs of heads stay one part: 8 heads from 2 ranks into 4
    assert handoff_parts(8, 8, 2, 4) == [
        HandoffPart(0, 0, 0, 0, 2),
        HandoffPart(0, 1, 2, 0, 2),
        HandoffPart(1, 2, 0, 0, 2),
        HandoffPart(1, 3, 2, 0, 2),
    ]

    # ranks that each hold every head (the experts split alone): each receiver rank gets them all, and such a sender
    # worker is one of degree 1 (its rank 0 sends)
    assert handoff_parts(4, 2, 2, 1, 2) == [
        HandoffPart(0, 0, 0, 0, 1),
        HandoffPart(1, 0, 0, 1, 1),
        HandoffPart(0, 1, 0, 0, 1),
        HandoffPart(1, 1, 0, 1, 1),
    ]
    assert handoff_parts(4, 2, 1, 1, 2) == [HandoffPart(0, 0, 0, 0, 2), HandoffPart(0, 1, 0, 0, 2)]


def test_a_kv_address_says_how_its_ranks_hold_the_heads():
    from worker.messages import join_kv_address, split_kv_address

    assert split_kv_address(join_kv_address(["tcp://a:1", "tcp://a:2"], 2)) == (["tcp://a:1", "tcp://a:2"], 2)
    whole = join_kv_address(["tcp://a:1", "tcp://a:2"], 1)
    assert whole == "1@tcp://a:1|tcp://a:2" and split_kv_address(whole) == (["tcp://a:1", "tcp://a:2"], 1)
    assert split_kv_address(join_kv_address(["tcp://a:1"], 1)) == (["tcp://a:1"], 1)
    with pytest.raises(ValueError, match="kv_address"):
        split_kv_address("1@tcp://a:1||tcp://a:2")
    assert HeadSplit(1, 2, 0, 4, 0, 2, 2, 1).holders == 2  # both ranks hold both heads: the first gives them


# ---- ranks as processes ------------------------------------------------------------------------------------------


def _config(model: str, size: int):
    from engine.config import EngineConfig

    return EngineConfig(
        model=model, dtype="float32", kv_blocks=64, block_size=4, max_batch_tokens=16, tensor_parallel_size=size
    )


def _params(logprobs: bool = True):
    from engine.request import SamplingParams

    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0 if logprobs else None, ignore_eos=True)


def _group(rank: int, size: int, store_path: str):
    import torch.distributed as dist

    from engine.tensor_parallel import TPGroup

    torch.set_num_threads(1)
    return TPGroup(dist.FileStore(store_path, size), rank, size, 60.0) if size > 1 else None


def _rank_kv(kv_spec, split, cache, secret: str, receives: bool, land=None):
    """A rank's endpoints on zmq over loopback (a worker builds them from its spec: worker.rank_kv.rank_kv)."""
    from transfer.config import TransferConfig
    from worker.rank_kv import cache_land, plain_rank_kv

    if receives and land is None:
        land = cache_land(cache)
    return plain_rank_kv(kv_spec, split, cache, "zmq", TransferConfig(secret=secret), land if receives else None)


def _follower(rank: int, size: int, store_path: str, job: dict, receives: bool) -> dict:
    from engine.engine_parts import build_engine_parts
    from engine.tensor_parallel import StepChannel, TPFollower

    group = _group(rank, size, store_path)
    parts = build_engine_parts(_config(job["model"], size), group)
    kv = _rank_kv(parts.kv_spec, parts.runner.head_split, parts.kv_cache, job["secret"], receives)
    kv.start_polling()
    try:
        ended = TPFollower(parts.runner, StepChannel(group), kv).serve()
    finally:
        group.close()
        kv.close()
    left = kv.pending()
    return {"ended": ended, "cache": torch.stack(parts.kv_cache.kv), "split": _split(parts.runner), "left": left}


def _split(runner) -> tuple:
    return dataclasses.astuple(runner.head_split)


def _worker(rank: int, size: int, store_path: str, job: dict, receives: bool):
    """Rank 0's engine and its hand-off endpoints."""
    from engine.llm_engine import LLMEngine
    from worker.handoff_join import HandoffReceiver, HandoffSender

    engine = LLMEngine(_config(job["model"], size), _group(rank, size, store_path))
    land = engine.kv_importer.write if receives else None
    kv = _rank_kv(engine.kv_spec, engine.runner.head_split, engine.kv_cache, job["secret"], receives, land)
    channel = engine.runner.step_channel
    receiver = HandoffReceiver(kv, channel) if receives else None
    return engine, kv, HandoffSender(kv, channel), receiver


def _wait(poll, ids, what: str) -> dict:
    """Each id's end event, polling until all came (at most WAIT_S)."""
    pending, events, deadline = set(ids), {}, time.monotonic() + WAIT_S
    while pending:
        assert time.monotonic() < deadline, f"{what}: {sorted(pending)} never ended"
        for event in poll():
            if event.transfer_id in pending:
                pending.discard(event.transfer_id)
                events[event.transfer_id] = event
        time.sleep(0.0005)
    return events


def _finish(engine, kv, out: dict) -> dict:
    engine.check_no_leaks()
    engine.close()  # stops the followers
    left = kv.pending()
    kv.close()
    return out | {"cache": torch.stack(engine.kv_cache.kv), "split": _split(engine.runner), "left": left}


def _prefill_main(rank: int, size: int, store_path: str, job: dict) -> dict:
    """Prompts prefilled as a prefill worker does: each layer's KV streams from every rank to the decode worker's
    ranks that hold its heads; then the leases end and the blocks go back."""
    if rank > 0:
        return _follower(rank, size, store_path, job, receives=False)
    from engine.outputs import FinishReason

    engine, kv, sender, _ = _worker(rank, size, store_path, job, receives=False)
    address, offer = job["offers"].get(timeout=WAIT_S)
    blocks: dict[str, list[int]] = {}
    for rid, prompt in offer.items():
        engine.add_request(prompt["ids"], _params(), rid, prefill_only=True, kv_sink=sender.sink(rid, prompt["dst"]))
        sender.begin(rid, address, prompt["dst"])
    first_tokens: dict[str, int] = {}
    while engine.has_unfinished() and len(first_tokens) < len(offer):
        for output in engine.step():
            assert output.finish_reason is FinishReason.PREFILLED, output.error
            first_tokens[output.request_id] = output.new_token_ids[0]
            blocks[output.request_id] = list(engine.requests[output.request_id].block_ids)
            sender.finish(output.request_id)
    events = _wait(sender.poll, offer, "the prefill leases")
    assert all(e.ok for e in events.values()), {r: str(e.error) for r, e in events.items()}
    for rid in offer:
        engine.abort(rid)  # its lease ended: the blocks go back, as a prefill worker's do
    job["first_tokens"].put(first_tokens)
    return _finish(engine, kv, {"blocks": blocks, "bytes": sum(e.nbytes for e in events.values())})


def _decode_main(rank: int, size: int, store_path: str, job: dict) -> dict:
    """Reservations whose KV comes from the prefill worker's ranks (each rank here expects its parts), decoded."""
    if rank > 0:
        return _follower(rank, size, store_path, job, receives=True)
    engine, kv, _, receiver = _worker(rank, size, store_path, job, receives=True)
    assert receiver is not None and len(receiver.address.split("|")) == size
    offer, blocks = {}, {}
    for i, prompt in enumerate(PROMPTS):
        rid, ids = f"r{i}", engine.tokenize(prompt)
        blocks[rid] = engine.kv_importer.reserve(ids, _params(), rid)
        assert blocks[rid] is not None
        expected = engine.kv_importer.expected_blocks(engine.requests[rid])
        receiver.expect(rid, expected, source_degree=job["prefill_degree"])
        offer[rid] = {"ids": ids, "dst": expected}
    job["offers"].put((receiver.address, offer))
    events = _wait(receiver.poll, offer, "the decode hand-offs")
    assert all(e.ok for e in events.values()), {r: str(e.error) for r, e in events.items()}
    assert not receiver.pending_transfers()
    first_tokens = job["first_tokens"].get(timeout=WAIT_S)
    for rid in offer:
        assert engine.kv_importer.kv_done(rid)
        engine.kv_importer.tokens_in(rid, [first_tokens[rid]])
    tokens = {rid: [t] for rid, t in first_tokens.items()}
    logprobs: dict[str, list[float]] = {rid: [] for rid in tokens}
    while engine.has_unfinished():
        for output in engine.step():
            assert output.error is None, output.error
            tokens[output.request_id] += output.new_token_ids
            logprobs[output.request_id] += [lp.logprob for lp in output.logprobs or []]
    out = {"tokens": tokens, "logprobs": logprobs, "blocks": blocks, "prompts": {r: o["ids"] for r, o in offer.items()}}
    return _finish(engine, kv, out | {"bytes": sum(e.nbytes for e in events.values())})


def _alone_main(rank: int, size: int, store_path: str, model: str) -> dict:
    from engine.llm_engine import LLMEngine

    torch.set_num_threads(1)
    engine = LLMEngine(_config(model, 1))
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, _params(), f"r{i}")
    while engine.has_unfinished():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            logprobs.setdefault(output.request_id, []).extend(lp.logprob for lp in output.logprobs or [])
    engine.check_no_leaks()
    engine.close()
    return {"tokens": tokens, "logprobs": logprobs}


def _both(first: tuple, second: tuple, job: dict) -> tuple[dict, dict]:
    """Two workers at once (each ``(main, degree)``), every rank a process; each one's results by rank."""
    results: dict[int, Any] = {}

    def side(index: int, main, degree: int) -> None:
        try:
            results[index] = run_ranks(main, degree, job, timeout_s=300)
        except BaseException as exc:  # noqa: BLE001 - raised below
            results[index] = exc

    threads = [threading.Thread(target=side, args=(i, *s)) for i, s in enumerate((first, second))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(400)
    for index in (0, 1):
        if not isinstance(results.get(index), dict):
            raise AssertionError(f"worker {index}: {results.get(index, 'never ended')}")
    return results[0], results[1]


def _job(model: Path, **more) -> dict:
    ctx = multiprocessing.get_context("spawn")
    return {"model": str(model), "secret": "s" * 32, "offers": ctx.Queue(), "first_tokens": ctx.Queue()} | more


def _reassembled(ranks: dict[int, dict], block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """Every head of ``block_ids``' first ``num_tokens`` slots, from each rank's cache: [layers, 2, tokens, heads, hd]."""
    parts = [ranks[r]["cache"][:, :, block_ids] for r in range(len(ranks))]
    return HeadSplit(*ranks[0]["split"]).whole_kv(parts).flatten(2, 3)[:, :, :num_tokens]


def _no_leftovers(*workers: dict) -> None:
    for ranks in workers:
        for rank, result in ranks.items():
            assert result["left"] == 0, (rank, result["left"])
            assert rank == 0 or result["ended"] == "stop", (rank, result["ended"])


@pytest.fixture(scope="module")
def alone(tiny_llama_path: Path) -> dict:
    return run_ranks(_alone_main, 1, str(tiny_llama_path))[0]


@pytest.mark.parametrize(
    ("prefill_degree", "decode_degree"),
    # (1, 2) and (2, 1) in `make test`; the other crossings in `make test-e2e` (for the suite's 20 minutes)
    [(1, 2), (2, 1), *(pytest.param(p, d, marks=pytest.mark.e2e) for p, d in ((2, 2), (4, 2)))],
)
def test_each_rank_sends_its_heads_bit_identical_and_the_worker_decodes_as_one_engine(
    tiny_llama_path: Path, alone: dict, prefill_degree: int, decode_degree: int
):
    job = _job(tiny_llama_path, prefill_degree=prefill_degree)
    decode, prefill = _both((_decode_main, decode_degree), (_prefill_main, prefill_degree), job)
    _no_leftovers(decode, prefill)
    for rid, prompt in decode[0]["prompts"].items():
        n = len(prompt)
        sent = _reassembled(prefill, prefill[0]["blocks"][rid], n)
        assert sent.shape[-2] == 2  # every KV head of the model, from whichever ranks hold it
        assert torch.equal(_reassembled(decode, decode[0]["blocks"][rid], n), sent), rid
    assert decode[0]["bytes"] == prefill[0]["bytes"] > 0  # every part acknowledged what it carried
    got = decode[0]
    assert got["tokens"] == alone["tokens"]
    gap = max(
        abs(a - b)
        for rid in got["logprobs"]
        for a, b in zip(got["logprobs"][rid], alone["logprobs"][rid][1:], strict=True)
    )
    print(f"({prefill_degree}, {decode_degree}): largest logprob gap against one engine alone: {gap:.2e}")
    assert gap < LOGPROB_TOLERANCE


# ---- a move between tensor-parallel decode workers: the same parts, with a decoding source ------------------------

MOVE_RID = "r0"  # PROMPTS[0], decoded by the source until it has MOVED_AFTER tokens, then by the target
PRECOPY_AFTER, MOVED_AFTER = 2, 4  # output tokens when the pre-copy is read, and when the source stops it


def _move_source_main(rank: int, size: int, store_path: str, job: dict) -> dict:
    """A decoding request: its full blocks leave while it decodes on (every rank its heads), then it is frozen and
    the rest leaves; as a decode worker's ``Export`` does."""
    if rank > 0:
        return _follower(rank, size, store_path, job, receives=True)
    engine, kv, sender, receiver = _worker(rank, size, store_path, job, receives=True)
    assert receiver is not None
    engine.add_request(PROMPTS[0], _params(), MOVE_RID)
    tokens, logprobs = [], []

    def step_until(count: int) -> None:
        while len(tokens) < count:
            for output in engine.step():
                tokens.extend(output.new_token_ids)
                logprobs.extend(lp.logprob for lp in output.logprobs or [])

    step_until(PRECOPY_AFTER)
    request = engine.requests[MOVE_RID]
    job["offers"].put(("reserve", request.num_computed_tokens, engine.tokenize(PROMPTS[0])))
    address, target_rid, dst = job["first_tokens"].get(timeout=WAIT_S)
    sender.begin(target_rid, address)
    layers, block_size = range(engine.kv_spec.num_layers), engine.config.block_size
    precopy = request.num_computed_tokens // block_size

    def send_held(first: int, end: int) -> None:
        engine.kv_exporter.export_held(request, sender.sink(target_rid, dst), first, end, layers)
        sender.send_held(target_rid, request.block_ids[first:end], dst[first:end], layers)

    send_held(0, precopy)
    step_until(MOVED_AFTER)
    frozen = engine.freeze(MOVE_RID)
    end = -(-request.num_computed_tokens // block_size)
    send_held(precopy, end)
    sender.finish(target_rid)
    events = _wait(sender.poll, [target_rid], "the move's lease")
    assert events[target_rid].ok, events[target_rid].error
    blocks = list(request.block_ids[:end])
    engine.release(MOVE_RID)
    job["offers"].put(("frozen", frozen))
    out = {"tokens": tokens, "frozen": frozen, "logprobs": logprobs, "blocks": blocks, "end": end}
    return _finish(engine, kv, out | {"prompt": engine.tokenize(PROMPTS[0])})


def _move_target_main(rank: int, size: int, store_path: str, job: dict) -> dict:
    """The move's target: reserves the context, expects a leading run of blocks from the source's ranks, takes the
    frozen tokens and decodes the rest."""
    if rank > 0:
        return _follower(rank, size, store_path, job, receives=True)
    engine, kv, _, receiver = _worker(rank, size, store_path, job, receives=True)
    assert receiver is not None
    _, context, prompt = job["offers"].get(timeout=WAIT_S)
    rid = MOVE_RID + ".1"
    blocks = engine.kv_importer.reserve(prompt, _params(), rid, context_tokens=context, headroom_tokens=8)
    assert blocks is not None
    expected = engine.kv_importer.expected_blocks(engine.requests[rid])
    receiver.expect(rid, expected, leading_run=True, source_degree=job["source_degree"])
    job["first_tokens"].put((receiver.address, rid, expected))
    event = _wait(receiver.poll, [rid], "the move's KV")[rid]
    assert event.ok, event.error
    _, frozen = job["offers"].get(timeout=WAIT_S)
    engine.kv_importer.tokens_in(rid, frozen)
    assert engine.kv_importer.kv_done(rid, event.num_blocks)
    tokens, logprobs = [], []
    while engine.has_unfinished():
        for output in engine.step():
            assert output.error is None, output.error
            tokens += output.new_token_ids
            logprobs += [lp.logprob for lp in output.logprobs or []]
    out = {"tokens": tokens, "logprobs": logprobs, "blocks": expected[: event.num_blocks]}
    return _finish(engine, kv, out)


@pytest.mark.parametrize(
    ("source_degree", "target_degree"),
    [(2, 1), (2, 2)],
)
@pytest.mark.e2e  # `make test-e2e` (for the suite's 20 minutes): tests/cluster/test_migration_cluster.py moves a stream
# between tensor-parallel decode workers through the router
def test_a_request_moves_between_tensor_parallel_workers_rank_to_rank_token_exact(
    tiny_llama_path: Path, alone: dict, source_degree: int, target_degree: int
):
    job = _job(tiny_llama_path, source_degree=source_degree)
    target, source = _both((_move_target_main, target_degree), (_move_source_main, source_degree), job)
    _no_leftovers(target, source)
    moved = source[0]
    assert moved["frozen"] == moved["tokens"] and len(moved["tokens"]) == MOVED_AFTER
    n = len(moved["prompt"]) + MOVED_AFTER - 1  # the KV that crossed: every token but the last one
    sent = _reassembled(source, moved["blocks"], n)
    assert torch.equal(_reassembled(target, target[0]["blocks"], n), sent)  # each rank took its heads, exactly
    tokens = moved["tokens"] + target[0]["tokens"]
    assert tokens == alone["tokens"][MOVE_RID]  # the stream one engine alone gives, token for token
    logprobs = moved["logprobs"] + target[0]["logprobs"]
    gap = max(abs(a - b) for a, b in zip(logprobs, alone["logprobs"][MOVE_RID], strict=True))
    print(f"move ({source_degree} -> {target_degree}): largest logprob gap against one engine alone: {gap:.2e}")
    assert gap < LOGPROB_TOLERANCE
