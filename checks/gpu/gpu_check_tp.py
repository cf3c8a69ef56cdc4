"""gpu-check's tensor-parallel section: one engine at degree 2 on two devices, and KV hand-offs between workers of
degrees 1 and 2, each rank sending and taking its own heads.

It runs where the machine has two CUDA devices (ranks on cuda:0 and cuda:1, the layers' all-reduces on NCCL), and
on the CPU over gloo for its unit test; with fewer devices the section is ``{"skipped": ...}`` (``skip_reason``).
Every rank is a spawned process (engine.tp_launch.run_ranks), so no piece shares this process's device memory.
Pieces, each under its own deadline, each one's failure its own ``error``:
1. ``degree_1`` and ``degree_2``: one engine's float32 greedy tokens of the same prompts (``greedy``: degree 2 against
   degree 1, else the first flipped token with both degrees' logprobs), then bfloat16 decode tokens/s per batch with
   the default config (CUDA graphs on). At degree 2 also whether graphs were captured and the device group's backend.
2. ``handoffs``: for each (prefill degree, decode degree) and KV-plane backend, a prefill worker streams its prompts'
   KV from every rank to the decode worker's ranks that hold those heads (worker/rank_kv.py): one round decoded to
   the end (its tokens against ``degree_1``'s), then timed rounds, GB/s from the prefill step's start to the last
   part's arrival. Prefill rank r runs on device r, decode rank r on the other end of the list, so parts cross devices.
"""

from __future__ import annotations

import gc
import multiprocessing
import queue
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch

from checks.gpu import gpu_check_engine as eng
from checks.gpu.gpu_check_models import random_prompts
from checks.gpu.gpu_check_time import Deadline, OutOfTime

NAME = "tensor_parallel_2"
DEGREE = 2
SECRET = "gpu-check-tp-secret-0123456789abc"
GROUP_TIMEOUT_S = 60.0
# each piece's own cap within the section's (seconds): a hung piece leaves time for the next
PIECE_CAPS = {"degree_1": 75.0, "degree_2": 90.0, "handoff": 90.0}


def skip_reason(device: str) -> str | None:
    """Why this machine cannot run the section (None: it has two devices)."""
    if not device.startswith("cuda") or not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return "no CUDA device"
    if torch.cuda.device_count() < DEGREE:
        return "one device"
    return None


def devices(device: str) -> list[str]:
    """The section's devices by rank: cuda:0 and cuda:1, or the CPU twice."""
    return [f"cuda:{i}" for i in range(DEGREE)] if device.startswith("cuda") else ["cpu"] * DEGREE


def transfer_backends(device: str) -> list[str]:
    """The KV-plane backends to hand off over: zmq always; nccl where torch has it on CUDA (gloo pairs on the CPU)."""
    import torch.distributed as dist

    if device.startswith("cuda") and not dist.is_nccl_available():
        return ["zmq"]
    return ["zmq", "nccl"]


# ---- inside every rank -------------------------------------------------------------------------------------------


def _rank_start(device: str) -> None:
    if device.startswith("cuda"):
        from transfer import nccl_env

        nccl_env.set_at_process_start()  # as a worker process starts, before any thread
        torch.cuda.set_device(torch.device(device))
    else:
        torch.set_num_threads(1)  # the ranks share the host's cores


def _group(rank: int, size: int, store_path: str, device: str) -> Any:
    import torch.distributed as dist

    from engine.tensor_parallel import TPGroup

    if size == 1:
        return None
    return TPGroup(dist.FileStore(store_path, size), rank, size, GROUP_TIMEOUT_S, device=device)


def _config(job: dict[str, Any], size: int, device: str, dtype: str, **settings: Any) -> Any:
    from engine.config import EngineConfig

    return EngineConfig(
        model=job["folder"], device=device, dtype=dtype, tensor_parallel_size=size, **settings
    )  # fmt: skip


def _exact_config(job: dict[str, Any], size: int, device: str) -> Any:
    s = job["sizes"]
    return _config(
        job, size, device, "float32", kv_cache_memory_bytes=job["exact_kv_bytes"],
        max_model_len=s["exact_prompt_len"] + s["exact_tokens"] + 16,
    )  # fmt: skip


def _decode_config(job: dict[str, Any], size: int, device: str) -> Any:
    s = job["sizes"]
    return _config(
        job, size, device, "bfloat16", kv_cache_memory_bytes=job["decode_kv_bytes"], cuda_graphs=True,
        max_num_seqs=max(s["batches"]), max_batch_tokens=max(2048, s["decode_prompt_len"]),
        max_model_len=s["decode_prompt_len"] + s["decode_tokens"] + 16,
    )  # fmt: skip


def _handoff_config(job: dict[str, Any], size: int, device: str) -> Any:
    s = job["sizes"]
    longest = max(s["handoff_prompt_len"], s["exact_prompt_len"] + s["exact_tokens"])
    return _config(
        job, size, device, "float32", kv_cache_memory_bytes=job["handoff_kv_bytes"],
        max_batch_tokens=max(2048, s["handoff_prompts"] * s["handoff_prompt_len"]), max_model_len=longest + 32,
        enable_prefix_caching=False,  # every round moves all of its KV
    )  # fmt: skip


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _serve(group: Any, configs: list[Any], make_kv: Any = None) -> dict[str, Any]:
    """A rank other than 0: its shard of each config's engine in turn, serving rank 0's steps until rank 0 stops it;
    ``make_kv(parts, i)``: the rank's KV endpoints of round ``i`` (a round per stop, on the last config's shard)."""
    from engine.engine_parts import build_engine_parts
    from engine.tensor_parallel import StepChannel, TPFollower

    ended, steps, paths = "", 0, []
    try:
        for config in configs:
            parts = build_engine_parts(config, group)
            rounds = 1 if make_kv is None else make_kv.rounds
            for i in range(rounds):
                kv = make_kv(parts, i) if make_kv is not None else None
                try:
                    if kv is not None:
                        kv.start_polling()
                    follower = TPFollower(parts.runner, StepChannel(group), kv)
                    ended = follower.serve()
                    steps += follower.steps
                finally:
                    if kv is not None:
                        paths.append(sorted(set(kv.paths().values())))
                        kv.close()
                if ended != "stop":
                    return {"ended": ended, "steps": steps, "paths": paths}
            graphs = parts.runner.decode_graphs
            if graphs is not None:
                graphs.close()
            del parts, graphs
            _free()  # this shard's weights and KV gone before the next engine's are built
    finally:
        group.close()
    return {"ended": ended, "steps": steps, "paths": paths}


def _greedy_logprobs(
    engine: Any, prompts: list[list[int]], max_tokens: int, deadline: Deadline
) -> tuple[list[list[int]], list[list[tuple[float, float | None]]]]:
    """Greedy tokens, and per token (its logprob, the runner-up's logprob)."""
    from engine.request import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    ids = [engine.add_request(p, params.copy(), f"exact-{i}") for i, p in enumerate(prompts)]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    logprobs: dict[str, list[tuple[float, float | None]]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        deadline.check("greedy decoding in float32")
        for out in engine.step():
            if out.error is not None:
                raise eng.RequestFailed(f"request {out.request_id} failed: {out.error}")
            tokens[out.request_id] += out.new_token_ids
            for lp in out.logprobs or []:
                runner_up = next((value for token, value in lp.top if token != lp.token_id), None)
                logprobs[out.request_id].append((lp.logprob, runner_up))
    engine.check_no_leaks()
    return [tokens[r] for r in ids], [logprobs[r] for r in ids]


def _tokens_per_s(engine: Any, job: dict[str, Any], deadline: Deadline) -> dict[str, float]:
    """Decode tokens/s per batch: each batch once untimed (lazy captures, first launches), then timed."""
    s, vocab = job["sizes"], job["vocab"]
    figures: dict[str, float] = {}
    for b in s["batches"]:
        eng.decode_tps(engine, b, s["decode_prompt_len"], s["decode_tokens"], vocab, deadline)
        figures[str(b)] = round(
            eng.decode_tps(engine, b, s["decode_prompt_len"], s["decode_tokens"], vocab, deadline), 1
        )
    return figures


def _degree_main(rank: int, size: int, store_path: str, job: dict[str, Any]) -> dict[str, Any]:
    """One engine at degree ``size``: its float32 greedy tokens, then its bfloat16 decode tokens/s."""
    from engine.llm_engine import LLMEngine

    device = job["devices"][rank]
    _rank_start(device)
    group = _group(rank, size, store_path, device)
    if rank > 0:
        return _serve(group, [_exact_config(job, size, device), _decode_config(job, size, device)])
    deadline: Deadline = job["deadline"]
    out: dict[str, Any] = {"devices": job["devices"][:size]}
    engine = None
    try:
        t0 = time.perf_counter()
        engine = LLMEngine(_exact_config(job, size, device), group)
        out["start_s"] = round(time.perf_counter() - t0, 2)
        out["tokens"], out["logprobs"] = _greedy_logprobs(
            engine, job["prompts"], job["sizes"]["exact_tokens"], deadline
        )
        if group is not None:
            engine.runner.step_channel.stop()  # the followers move on to the next engine's shard, on the same groups
        eng.close_engine(engine)
        engine = None
        engine = LLMEngine(_decode_config(job, size, device), group)
        out["cuda_graphs"] = engine.config.cuda_graphs
        eng.smoke(engine, deadline)
        out["tokens_per_s"] = _tokens_per_s(engine, job, deadline)
        out["graphs"] = eng.graph_info(engine)
        out["attention_backend"] = eng.backend_name(engine)
        if group is not None:
            out["device_group"] = group.device_backend  # what the worker asked for, by its device
            out["all_reduce_backend"] = _backend_of(group)  # what its process group holds
    finally:
        if engine is not None:
            engine.close()
        elif group is not None:
            group.close()
    return out


def _backend_of(group: Any) -> str:
    """The backend registered on the device group's process group (the one every all-reduce runs on)."""
    try:
        return str(group._device._get_backend_name())
    except (AttributeError, RuntimeError):
        return type(group._device._get_backend(group.device)).__name__


# ---- hand-offs between two workers -------------------------------------------------------------------------------


def _rank_kv(kv_spec: Any, split: Any, cache: Any, backend: str, device: str, land: Any) -> Any:
    """A rank's endpoints on ``backend`` over loopback; a receiver when ``land`` is given. The decode side offers no
    cache for direct writes, so parts between devices take NCCL pairs on nccl (a ring or frames on one device)."""
    from transfer.config import TransferConfig
    from worker.rank_kv import plain_rank_kv

    config = TransferConfig(
        secret=SECRET, device=device if backend == "nccl" else "cpu", kv_device=device, direct_write=False
    )
    return plain_rank_kv(kv_spec, split, cache, backend, config, land)


class _FollowerKV:
    """A follower's endpoints per round (one round per backend)."""

    def __init__(self, job: dict[str, Any], device: str, receives: bool) -> None:
        self.backends, self.device, self.receives = job["backends"], device, receives
        self.rounds = len(self.backends)

    def __call__(self, parts: Any, i: int) -> Any:
        from worker.rank_kv import cache_land

        land = cache_land(parts.kv_cache) if self.receives else None
        return _rank_kv(parts.kv_spec, parts.runner.head_split, parts.kv_cache, self.backends[i], self.device, land)


def _get(q: Any, deadline: Deadline, what: str) -> Any:
    try:
        return q.get(timeout=max(0.1, deadline.left()))
    except queue.Empty:
        raise OutOfTime(f"{deadline.what}: out of time while waiting for {what}") from None


def _wait(poll: Any, ids: list[str], deadline: Deadline, what: str) -> dict[str, Any]:
    """Each id's end event (all of them ``ok``, else RuntimeError), polling until all came."""
    pending, events = set(ids), {}
    while pending:
        deadline.check(f"waiting for {what}")
        for event in poll():
            if event.transfer_id in pending:
                if not event.ok:
                    raise RuntimeError(f"{what}: {event.transfer_id} failed: {event.error!r}")
                pending.discard(event.transfer_id)
                events[event.transfer_id] = event
        time.sleep(0.0002)
    return events


def _rounds(job: dict[str, Any]) -> list[tuple[str, list[list[int]]]]:
    """A backend's rounds: the exactness prompts decoded to the end, then a warm-up and the timed rounds."""
    s = job["sizes"]
    timed = random_prompts(s["handoff_prompts"], s["handoff_prompt_len"], job["vocab"], seed=31)
    return [("exact", job["prompts"])] + [(f"timed-{i}", timed) for i in range(1 + s["handoff_reps"])]


def _worker(rank: int, size: int, store_path: str, job: dict[str, Any], receives: bool) -> Any:
    from engine.llm_engine import LLMEngine

    device = job["decode_devices" if receives else "prefill_devices"][rank]
    _rank_start(device)
    group = _group(rank, size, store_path, device)
    config = _handoff_config(job, size, device)
    if rank > 0:
        return None, _serve(group, [config], _FollowerKV(job, device, receives))
    try:
        return LLMEngine(config, group), None
    except BaseException:
        if group is not None:
            group.close()
        raise


def _prefill_main(rank: int, size: int, store_path: str, job: dict[str, Any]) -> dict[str, Any]:
    """Per backend and round: the decode worker's offer prefilled in as few steps as fit, each layer's KV streamed
    from every rank; the first tokens and the step's start and end go back; the leases end, the blocks go back."""
    from engine.outputs import FinishReason
    from engine.request import SamplingParams
    from worker.handoff_join import HandoffSender

    engine, follower = _worker(rank, size, store_path, job, receives=False)
    if engine is None:
        return follower
    deadline: Deadline = job["deadline"]
    device = job["prefill_devices"][0]
    paths = []
    try:
        for i, backend in enumerate(job["backends"]):
            kv = _rank_kv(engine.kv_spec, engine.runner.head_split, engine.kv_cache, backend, device, None)
            sender = HandoffSender(kv, engine.runner.step_channel)
            try:
                for _ in _rounds(job):
                    address, offer = _get(job["offers"], deadline, "the decode worker's offer")
                    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
                    for rid, (ids, dst) in offer.items():
                        engine.add_request(ids, params.copy(), rid, prefill_only=True, kv_sink=sender.sink(rid, dst))
                        sender.begin(rid, address, dst)
                    firsts: dict[str, int] = {}
                    start = time.perf_counter()
                    while len(firsts) < len(offer):
                        deadline.check("prefilling the hand-off's prompts")
                        for output in engine.step():
                            if output.finish_reason is not FinishReason.PREFILLED:
                                raise RuntimeError(f"{output.request_id} did not prefill: {output.error}")
                            firsts[output.request_id] = output.new_token_ids[0]
                            sender.finish(output.request_id)
                    end = time.perf_counter()
                    job["firsts"].put((firsts, start, end))
                    _wait(sender.poll, list(offer), deadline, "the prefill leases")
                    for rid in offer:
                        engine.abort(rid)  # its lease ended: the blocks go back, as a prefill worker's do
                engine.check_no_leaks()
                paths.append(sorted(set(sender.paths().values())))
            finally:
                sender.close()
            if i + 1 < len(job["backends"]) and engine.runner.step_channel is not None:
                engine.runner.step_channel.stop()  # the followers make the next backend's endpoints
    finally:
        engine.close()
    return {"paths": paths}


def _decode_main(rank: int, size: int, store_path: str, job: dict[str, Any]) -> dict[str, Any]:
    """Per backend and round: reserve and expect every prompt's KV on every rank, time it in; decode the first round
    to the end; each backend's row goes to ``job["rows"]`` as it ends."""
    from engine.request import SamplingParams
    from worker.handoff_join import HandoffReceiver

    engine, follower = _worker(rank, size, store_path, job, receives=True)
    if engine is None:
        return follower
    deadline: Deadline = job["deadline"]
    device = job["decode_devices"][0]
    s = job["sizes"]
    try:
        for i, backend in enumerate(job["backends"]):
            kv = _rank_kv(
                engine.kv_spec, engine.runner.head_split, engine.kv_cache, backend, device, engine.kv_importer.write
            )
            receiver = HandoffReceiver(kv, engine.runner.step_channel)
            row: dict[str, Any] = {"backend": backend}
            rates, steps = [], []
            try:
                for name, prompts in _rounds(job):
                    params = SamplingParams(max_tokens=s["exact_tokens"], temperature=0.0, ignore_eos=True, logprobs=0)
                    offer = {}
                    for j, prompt in enumerate(prompts):
                        rid = f"{backend}-{name}-{j}"
                        if engine.kv_importer.reserve(prompt, params.copy(), rid) is None:
                            raise RuntimeError(f"no KV blocks free for {rid}")
                        dst = engine.kv_importer.expected_blocks(engine.requests[rid])
                        receiver.expect(rid, dst, source_degree=job["prefill_degree"])
                        offer[rid] = (prompt, dst)
                    _followers_caught_up(engine)
                    job["offers"].put((receiver.address, offer))
                    events = _wait(receiver.poll, list(offer), deadline, f"the {name} round's KV")
                    arrived = time.perf_counter()
                    firsts, start, end = _get(job["firsts"], deadline, "the prefill worker's first tokens")
                    nbytes = sum(e.nbytes for e in events.values())
                    if name == "exact":
                        row["exact"] = _decode_rest(engine, offer, firsts, deadline)
                        row["kv_bytes_exact_round"] = nbytes
                        continue
                    for rid in offer:
                        engine.abort(rid)
                    if name != "timed-0":  # the warm-up round is left out
                        rates.append(nbytes / max(arrived - start, 1e-9) / 1e9)
                        steps.append(end - start)
                        row["kv_bytes"] = nbytes
                engine.check_no_leaks()
                row["handoff_gb_s"] = float(f"{statistics.median(rates):.4g}")
                row["prefill_step_ms"] = round(1000 * statistics.median(steps), 2)
                row["rounds"] = len(rates)
                job["rows"].put(row)
            finally:
                receiver.close()
            if i + 1 < len(job["backends"]) and engine.runner.step_channel is not None:
                engine.runner.step_channel.stop()
    finally:
        engine.close()
    return {}


def _followers_caught_up(engine: Any) -> None:
    """Every follower has applied the ``Expect`` messages sent so far: they take the step channel in order, so one
    answered ``Hello`` proves it. ``Expect`` itself is not answered, and a sender this fast (its offer comes straight
    from this process) can otherwise reach a follower's receiver first ("unknown transfer")."""
    import msgspec

    from worker.rank_kv import Hello

    if engine.runner.step_channel is not None:
        engine.runner.step_channel.control(msgspec.msgpack.encode(Hello()), reply=True)


def _decode_rest(engine: Any, offer: dict[str, Any], firsts: dict[str, int], deadline: Deadline) -> dict[str, Any]:
    """The KV is in: admit each request with the prefill worker's first token and decode it to the end."""
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    for rid in offer:
        if not engine.kv_importer.kv_done(rid):
            raise RuntimeError(f"{rid}: its reservation ended before its KV was in")
        engine.kv_importer.tokens_in(rid, [firsts[rid]])
        tokens[rid], logprobs[rid] = [firsts[rid]], []
    while engine.has_unfinished():
        deadline.check("decoding after the hand-off")
        for out in engine.step():
            if out.error is not None:
                raise eng.RequestFailed(f"request {out.request_id} failed after the hand-off: {out.error}")
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += [lp.logprob for lp in out.logprobs or []]
    return {"tokens": [tokens[r] for r in offer], "logprobs": [logprobs[r] for r in offer]}


def _handoff(job: dict[str, Any], p: int, d: int, deadline: Deadline) -> tuple[list[dict[str, Any]], str | None]:
    """Both workers at once, every rank a process: the rows the decode worker reported, and an error if any."""
    from engine.tp_launch import run_ranks

    ctx = multiprocessing.get_context("spawn")
    devs = job["devices"]
    job = dict(
        job, deadline=deadline, prefill_degree=p, prefill_devices=devs[:p], decode_devices=devs[::-1][:d],
        offers=ctx.Queue(), firsts=ctx.Queue(), rows=ctx.Queue(),
    )  # fmt: skip
    results: dict[str, Any] = {}

    def side(name: str, main: Any, degree: int) -> None:
        try:
            results[name] = run_ranks(main, degree, job, timeout_s=max(5.0, deadline.left()))
        except BaseException as exc:  # noqa: BLE001 - recorded below
            results[name] = exc

    threads = [
        threading.Thread(target=side, args=("decode", _decode_main, d), daemon=True),
        threading.Thread(target=side, args=("prefill", _prefill_main, p), daemon=True),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(5.0, deadline.left()) + 90)  # run_ranks gives up at the deadline, then reaps its ranks
    rows = []
    while True:
        try:
            rows.append(job["rows"].get(timeout=0.5))
        except queue.Empty:
            break
    errors = [f"{n} worker: {eng.error_string(r)}" for n, r in results.items() if isinstance(r, BaseException)]
    errors += [f"{n} worker never ended" for n in ("decode", "prefill") if n not in results]
    prefill = results.get("prefill")
    if isinstance(prefill, dict):  # each backend's paths, by prefill rank
        for index, row in enumerate(rows):
            row["prefill_paths"] = {
                f"rank{r}": ranks["paths"][index] for r, ranks in sorted(prefill.items()) if index < len(ranks["paths"])
            }
    return rows, "; ".join(errors) or None


# ---- the section -------------------------------------------------------------------------------------------------


def exactness_prompts(sizes: dict[str, Any], vocab: int) -> list[list[int]]:
    """The prompts both degrees generate from, and the hand-offs' decoded round."""
    return random_prompts(sizes["exact_prompts"], sizes["exact_prompt_len"], vocab, seed=21)


def greedy_against(one: dict[str, Any], two: dict[str, Any]) -> dict[str, Any]:
    """Degree 2's float32 greedy tokens against degree 1's: exact rows, the largest logprob gap over the tokens both
    chose, and where a row first flips, both degrees' token and logprob there and degree 1's margin to its runner-up
    (a flip within that margin is a near tie that the ranks' summation order decides)."""
    result = eng.exactness(one["tokens"], two["tokens"])
    gap = 0.0
    flips = []
    for row, (t1, t2, l1, l2) in enumerate(zip(one["tokens"], two["tokens"], one["logprobs"], two["logprobs"])):
        diff = result["first_diff"][row]
        same = len(t1) if diff is None else diff
        gap = max([gap] + [abs(a[0] - b[0]) for a, b in zip(l1[:same], l2[:same])])
        if diff is not None and diff < min(len(t1), len(t2)):
            runner_up = l1[diff][1]
            flips.append({
                "row": row, "position": diff,
                "degree_1": {"token": t1[diff], "logprob": l1[diff][0]},
                "degree_2": {"token": t2[diff], "logprob": l2[diff][0]},
                "degree_1_margin": None if runner_up is None else l1[diff][0] - runner_up,
            })  # fmt: skip
    result.update(dtype="float32", max_logprob_gap=float(f"{gap:.3g}"), first_flip=flips[0] if flips else None)
    return result


def _handoff_exact(reference: dict[str, Any] | None, got: dict[str, Any] | None) -> dict[str, Any] | None:
    """The decode worker's tokens after the hand-off against degree 1 generating alone (both float32)."""
    if got is None:
        return None
    if reference is None or "tokens" not in reference:  # the tokens stay, for a reader to compare
        return {"error": "no degree-1 reference (its piece did not run or failed)", "tokens": got["tokens"]}
    result = eng.exactness(reference["tokens"], got["tokens"])
    gaps = [
        abs(a - b[0])
        for ours, ref in zip(got["logprobs"], reference["logprobs"])
        for a, b in zip(ours, ref[1:])  # the first token's logprob stays with the prefill worker
    ]
    result["max_logprob_gap"] = float(f"{max(gaps, default=0.0):.3g}")
    return result


def tensor_parallel_2(params: dict[str, Any], deadline: Deadline) -> dict[str, Any]:
    """The section (see the module's docstring). ``params``: folder, vocab, devices, sizes, pairs, backends."""
    from engine.tp_launch import run_ranks

    s = params["sizes"]
    kv_per_token = params["kv_bytes_per_token_float32"]
    job: dict[str, Any] = {
        "folder": params["folder"],
        "vocab": params["vocab"],
        "devices": params["devices"],
        "backends": params["backends"],
        "sizes": s,
        "prompts": exactness_prompts(s, params["vocab"]),
        "exact_kv_bytes": max(
            4 << 20, 2 * kv_per_token * s["exact_prompts"] * (s["exact_prompt_len"] + s["exact_tokens"] + 32)
        ),
        "decode_kv_bytes": params["decode_kv_bytes"],
        "handoff_kv_bytes": int(
            1.5 * kv_per_token * (s["handoff_prompts"] * (s["handoff_prompt_len"] + 16) + s["exact_prompts"] * 128)
        ),
    }
    out: dict[str, Any] = {"devices": params["devices"], "backends": params["backends"]}
    by_degree: dict[int, dict[str, Any]] = {}
    for size in params.get("degrees", (1, DEGREE)):
        name = f"degree_{size}"
        piece = deadline.within(PIECE_CAPS[name], name)
        t0 = time.monotonic()
        try:
            if piece.passed():
                raise OutOfTime("the section's time is spent")
            result = run_ranks(_degree_main, size, dict(job, deadline=piece), timeout_s=max(5.0, piece.left()))[0]
            by_degree[size] = result
            out[name] = {k: v for k, v in result.items() if k not in ("tokens", "logprobs")}
        except Exception as exc:  # noqa: BLE001 (recorded: the other pieces still run)
            out[name] = {"error": eng.error_string(exc)}
        out[name]["piece_s"] = round(time.monotonic() - t0, 1)
    one, two = by_degree.get(1), by_degree.get(DEGREE)
    if one is not None and two is not None:
        out["greedy"] = greedy_against(one, two)
        out["decode_degree_2_vs_1"] = {
            b: round(two["tokens_per_s"][b] / one["tokens_per_s"][b], 3) for b in one["tokens_per_s"]
        }
    if two is not None:
        graphs = two.get("graphs")
        out["graphs_captured_at_degree_2"] = None if graphs is None else bool(graphs.get("num_graphs"))
    rows: list[dict[str, Any]] = []
    out["handoffs"] = rows
    for p, d in params["pairs"]:
        piece = deadline.within(PIECE_CAPS["handoff"], f"hand-off ({p}, {d})")
        t0 = time.monotonic()
        try:
            if piece.passed():
                raise OutOfTime("the section's time is spent")
            got, error = _handoff(job, p, d, piece)
        except Exception as exc:  # noqa: BLE001
            got, error = [], eng.error_string(exc)
        for row in got:
            row["exact"] = _handoff_exact(one, row.get("exact"))
        reported = {row["backend"] for row in got}
        got += [{"backend": b, "error": error or "no result"} for b in params["backends"] if b not in reported]
        where = {"prefill_devices": job["devices"][:p], "decode_devices": job["devices"][::-1][:d]}
        for row in got:
            rows.append(
                {"prefill_degree": p, "decode_degree": d, **where, **row, "piece_s": round(time.monotonic() - t0, 1)}
            )
    out["handoffs_exact"] = _all_exact(rows)
    return out


def _all_exact(rows: list[dict[str, Any]]) -> bool | None:
    """Every hand-off token-exact; False when one failed or flipped, None when none ran or some had no reference."""
    if not rows:
        return None
    if any("error" in row for row in rows):
        return False
    values = [(row.get("exact") or {}).get("exact") for row in rows]
    return None if None in values else all(values)


def section_params(
    folder: Path, vocab: int, kv_bytes_per_token_float32: int, device: str, sizes: dict[str, Any], pairs: list
) -> dict[str, Any]:
    return {
        "folder": str(folder),
        "vocab": vocab,
        "kv_bytes_per_token_float32": kv_bytes_per_token_float32,
        "decode_kv_bytes": int(
            1.25
            * max(sizes["batches"])
            * (sizes["decode_prompt_len"] + sizes["decode_tokens"] + 48)
            * kv_bytes_per_token_float32
            // 2
        ),  # fmt: skip
        "devices": devices(device),
        "backends": transfer_backends(device),
        "sizes": sizes,
        "pairs": [tuple(pair) for pair in pairs],
    }
