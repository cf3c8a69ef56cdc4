"""gpu-check's prefill/decode pair: two processes on one device over the same-node transfer path (the shm backend).

Each process runs a worker's engine and transfer endpoint without its sockets or Ray, glued as prefill/worker.py and
decode/worker.py glue them; the decode process drives, the prefill one answers over a pipe. Two phases, fresh engines:
1. **float32**, over the nccl backend: on one GPU the prefill side writes KV into the decode engine's cache through
   CUDA IPC handles (transfer/direct_path.py, ``kv_path``); the pair's tokens against the same engine generating
   alone, token-exact, first token included (bfloat16 may differ in the last bits: cuBLAS picks kernels by batch
   shape, and the sides batch differently).
2. **bfloat16**, over shm (device KV staged through pinned host memory, then one copy into the decode engine's cache
   through the same handles): the pair's tokens teacher-forced through the engine alone (``top1_agreement``); the GB/s of a long
   prompt's KV sent after its whole prefill (first ``send_layer`` to DONE: no prefill compute in the window); the p99
   interval between decode steps of ``running`` requests, idle and while that KV arrives, every decode graph they can
   meet captured first (a capture synchronises the device; ``graphs_captured_while_measuring``).
Every wait is bounded by ``timeout_s``; a failure on either side ends the pair with that side's error.
"""

from __future__ import annotations

import multiprocessing as mp
import tempfile
import time
import traceback
from typing import Any

SECRET = "gpu-check-pair-secret-0123456789"
PHASES = (("float32", "nccl"), ("bfloat16", "shm"))  # (dtype, transfer backend)


def _engine(folder: str, device: str, dtype: str, max_model_len: int, kv_bytes: int, max_num_seqs: int, **extra: Any):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    return LLMEngine(
        EngineConfig(
            model=folder,
            device=device,
            dtype=dtype,
            max_model_len=max_model_len,
            kv_cache_memory_bytes=kv_bytes,
            max_num_seqs=max_num_seqs,
            max_batch_tokens=2048,
            **extra,
        )
    )


def _greedy(max_tokens: int, **extra: Any):
    from engine.request import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **extra)


def prefill_main(conn: Any, folder: str, device: str, max_model_len: int) -> None:
    """The prefill process. In: ("engine", dtype, kv_bytes) builds its engine and sender anew (answers ("ready",
    dtype)); ("request", rid, prompt, dst_blocks, address, stream) prefills one; None ends it. Out: (rid, first token,
    first send time), (rid, None, error), or ("error", traceback)."""
    from transfer import nccl_env

    nccl_env.set_at_process_start()  # as a worker process starts (this pair moves KV over shm, but the rule holds)
    from engine.request import FinishReason
    from transfer.base import make_sender
    from transfer.config import TransferConfig
    from transfer.wire import ModelFingerprint

    sender = engine = None
    try:
        first_send: dict[str, float] = {}
        while True:
            if conn.poll(0.001):
                msg = conn.recv()
                if msg is None:
                    break
                if msg[0] == "engine":
                    if sender is not None:
                        sender.close()
                    engine = sender = None
                    engine = _engine(folder, device, msg[1], max_model_len, msg[2], 8, prefill_only=True)
                    engine.warm_up()
                    fingerprint = ModelFingerprint.from_spec(engine.kv_spec)
                    config = TransferConfig(secret=SECRET, device=device if msg[3] == "nccl" else "cpu")
                    sender = make_sender(msg[3], fingerprint, config)
                    conn.send(("ready", msg[1]))
                    continue
                _, rid, prompt, dst, address, stream = msg

                def sink(ready, rid=rid, dst=dst, sender=sender):
                    first_send.setdefault(rid, time.perf_counter())
                    sender.send_layer(rid, ready.layer, dst[ready.first_block : ready.end_block], ready.k, ready.v)

                engine.add_request(prompt, _greedy(1), rid, prefill_only=True, kv_sink=sink, stream_kv=stream)
                sender.begin(rid, address)
            if engine is None or sender is None:
                continue
            for output in engine.step() if engine.has_unfinished() else []:
                if output.finish_reason is FinishReason.PREFILLED:
                    sender.finish(output.request_id)
                    conn.send((output.request_id, output.new_token_ids[0], first_send.pop(output.request_id)))
                elif output.error is not None:
                    conn.send((output.request_id, None, output.error))
            for event in sender.poll():  # the lease ended (acked or failed): the blocks are free to go
                if event.transfer_id in engine.requests:
                    engine.release(event.transfer_id)
        if engine is not None:
            engine.check_no_leaks()
    except Exception:  # noqa: BLE001 (reported to the driving process, which puts it in the JSON)
        conn.send(("error", traceback.format_exc()[-2000:]))
    finally:
        if sender is not None:
            sender.close()


class DecodeSide:
    """The decode process's engine and receiver; ``tick`` is one turn of a decode worker's loop."""

    def __init__(self, conn: Any, engine: Any, address: str, end: float, backend: str) -> None:
        from transfer.base import make_receiver
        from transfer.config import TransferConfig
        from transfer.kv_segment import KVSegment
        from transfer.pair_path import gpu_uuid
        from transfer.wire import ModelFingerprint

        self.conn, self.engine, self.end = conn, engine, end
        self.first_write: dict[str, float] = {}
        self.done: dict[str, float] = {}
        self.firsts: dict[str, tuple[int, float]] = {}
        self.tokens: dict[str, list[int]] = {}
        # while set, first tokens wait here instead of admitting their request, so the steps measured while a long
        # prompt's KV arrives never include its own admission and first decode (a new context size)
        self.hold_first_tokens = False
        self.held: dict[str, int] = {}
        device = engine.config.device if backend == "nccl" else "cpu"
        config = TransferConfig(secret=SECRET, kv_device=engine.config.device, device=device)
        fingerprint = ModelFingerprint.from_spec(engine.kv_spec)
        segment = None
        if engine.kv_cache.kv[0].is_cuda:  # as decode/worker.py's shared_kv_cache offers a GPU cache
            kv = engine.kv_cache.kv
            segment = KVSegment(fingerprint, kv[0].shape[1], device_layers=kv, gpu=gpu_uuid(config))
        self.backend = backend
        self.receiver = make_receiver(backend, fingerprint, self._sink, address, config, segment)

    def _sink(self, rid: str, layer: int, blocks: list[int], k: Any, v: Any) -> None:
        self.first_write.setdefault(rid, time.perf_counter())
        self.engine.kv_importer.write(rid, layer, blocks, k, v)

    def check_time(self, what: str) -> None:
        if time.monotonic() > self.end:
            raise TimeoutError(f"the pair's time ran out waiting for {what}")

    def send(self, rid: str, prompt: list[int], max_tokens: int, stream: bool) -> None:
        blocks = self.engine.kv_importer.reserve(prompt, _greedy(max_tokens), rid)
        if blocks is None:
            raise RuntimeError(f"no KV blocks free for {rid}")
        missing = self.engine.kv_importer.expected_blocks(self.engine.requests[rid])
        self.receiver.expect(rid, missing, num_layers=self.engine.kv_spec.num_layers)
        self.tokens[rid] = []
        self.conn.send(("request", rid, prompt, missing, self.receiver.address, stream))

    def tick(self) -> float | None:
        """Poll the pipe and the receiver, run one step; the step's end time when it decoded tokens."""
        while self.conn.poll(0):
            message = self.conn.recv()
            if message[0] == "error":
                raise RuntimeError(f"prefill process failed: {message[1]}")
            rid, token, info = message
            if token is None:
                raise RuntimeError(f"prefill side failed {rid}: {info}")
            self.firsts[rid] = (token, info)
            self.tokens[rid].append(token)
            if self.hold_first_tokens:
                self.held[rid] = token
            else:
                self.engine.kv_importer.tokens_in(rid, [token])
        for event in self.receiver.poll():
            if not event.ok:
                raise RuntimeError(f"transfer {event.transfer_id} failed: {event.error!r}")
            self.done[event.transfer_id] = time.perf_counter()
            self.engine.kv_importer.kv_done(event.transfer_id)
        if not self.engine.has_unfinished():
            self.receiver.wait(0.001)
            return None
        outputs = self.engine.step()
        for output in outputs:
            if output.error is not None:
                raise RuntimeError(f"request {output.request_id} failed on the decode side: {output.error}")
            if output.request_id in self.tokens:
                self.tokens[output.request_id].extend(output.new_token_ids)
        return time.perf_counter() if any(o.new_token_ids for o in outputs) else None

    def run_until(self, condition: Any, what: str) -> None:
        while not condition():
            self.check_time(what)
            self.tick()

    def new_engine(self, dtype: str, kv_bytes: int) -> None:
        self.conn.send(("engine", dtype, kv_bytes, self.backend))
        while not self.conn.poll(0.05):
            self.check_time(f"the prefill process's {dtype} engine")
        ready = self.conn.recv()
        if ready != ("ready", dtype):
            raise RuntimeError(f"prefill process did not start its {dtype} engine: {ready}")

    def close(self) -> None:
        self.receiver.close()


def _p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]


def _pair_tokens(side: DecodeSide, prompts: list[list[int]], max_tokens: int, tag: str) -> list[list[int]]:
    rids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(rids, prompts):
        side.send(rid, prompt, max_tokens, stream=True)
    side.run_until(lambda: all(r not in side.engine.requests for r in rids), f"the {tag} requests")
    return [side.tokens[r] for r in rids]


def top1_agreement(engine: Any, prompts: list[list[int]], pair: list[list[int]]) -> dict[str, Any]:
    """The share of the pair's tokens that are the engine's own argmax, teacher-forced (prompt logprobs)."""
    agree = total = 0
    for prompt, tokens in zip(prompts, pair):
        rid = engine.add_request(prompt + tokens, _greedy(1, prompt_logprobs=1))
        scores = None
        while rid in engine.requests:
            for output in engine.step():
                if output.error is not None:
                    raise RuntimeError(f"scoring the pair's tokens failed: {output.error}")
                scores = output.prompt_logprobs or scores
        assert scores is not None
        for position, token in enumerate(tokens, start=len(prompt)):
            agree += scores[position] is not None and scores[position].top[0][0] == token
            total += 1
    return {"positions": total, "agree": agree, "top1_agreement": round(agree / max(total, 1), 4)}


def _float32_phase(side: DecodeSide, p: dict[str, Any], vocab: int) -> dict[str, Any]:
    from checks.gpu.gpu_check_models import random_prompts

    prompts = random_prompts(p["exact_prompts"], p["exact_prompt_len"], vocab, seed=11)
    reference = [r.token_ids for r in side.engine.generate(prompts, _greedy(p["exact_tokens"]))]
    side.engine.block_manager.reset_prefix_cache()
    ours = _pair_tokens(side, prompts, p["exact_tokens"], "exact")
    exact_rows = sum(a == b for a, b in zip(reference, ours))
    return {"rows": len(prompts), "exact_rows": exact_rows, "exact": exact_rows == len(prompts)}


def _bfloat16_phase(side: DecodeSide, p: dict[str, Any], vocab: int, out: dict[str, Any]) -> None:
    from checks.gpu.gpu_check_models import random_prompts

    engine = side.engine
    prompts = random_prompts(p["exact_prompts"], p["exact_prompt_len"], vocab, seed=11)
    pair = _pair_tokens(side, prompts, p["exact_tokens"], "agree")
    engine.block_manager.reset_prefix_cache()
    out["bfloat16"] = top1_agreement(engine, prompts, pair)
    engine.block_manager.reset_prefix_cache()

    running = [f"run-{i}" for i in range(p["running"])]
    for rid, prompt in zip(running, random_prompts(len(running), 64, vocab, seed=12)):
        engine.add_request(prompt, _greedy(p["max_model_len"] - 128), rid)
    side.run_until(lambda: all(engine.requests[r].output_token_ids for r in running), "running decodes")
    graphs = engine.runner.decode_graphs
    # the longest context the measured steps reach: the idle steps and at most the pair's wait of steps after them
    horizon = max(engine.requests[r].num_tokens for r in running) + p["idle_steps"] + p["during_steps_max"]
    out["graphs_warmed"] = graphs.warm(len(running), min(horizon, p["max_model_len"])) if graphs else None
    captured_before = graphs.num_graphs if graphs else 0
    stamps: list[float] = []
    while len(stamps) < p["idle_steps"]:
        side.check_time("the idle decode steps")
        stamp = side.tick()
        if stamp is not None:
            stamps.append(stamp)
    idle = [b - a for a, b in zip(stamps, stamps[1:])]
    during: list[float] = []
    rates = []
    long_prompts = random_prompts(p["long_prompts"], p["long_prompt_len"], vocab, seed=13)
    for i, prompt in enumerate(long_prompts):
        rid = f"long-{i}"
        side.hold_first_tokens = True
        side.send(rid, prompt, 2, stream=False)
        steps = [time.perf_counter()]
        while rid not in side.done or rid not in side.held:
            side.check_time(f"{rid}'s KV")
            stamp = side.tick()
            if stamp is not None:
                steps.append(stamp)
        start, end = side.first_write[rid], side.done[rid]
        during += [b - a for a, b in zip(steps, steps[1:]) if b > start and a < end]
        sent = side.firsts[rid][1] if rid in side.firsts else None
        nbytes = len(prompt) * engine.kv_spec.bytes_per_block // engine.kv_spec.block_size
        if sent is not None:
            rates.append(nbytes / max(end - sent, 1e-9) / 1e9)
        side.hold_first_tokens = False
        engine.kv_importer.tokens_in(rid, [side.held.pop(rid)])
        side.run_until(lambda rid=rid: rid not in engine.requests, f"{rid} to finish")
    out["graphs_captured_while_measuring"] = (graphs.num_graphs - captured_before) if graphs else None
    out["transfer_gbps"] = float(f"{sorted(rates)[len(rates) // 2]:.4g}") if rates else None
    out["kv_bytes_per_long_prompt"] = p["long_prompt_len"] * engine.kv_spec.bytes_per_block // engine.kv_spec.block_size
    out["itl_idle_p99_ms"] = None if not idle else round(1000 * _p99(idle), 3)  # type: ignore[operator]
    out["itl_during_p99_ms"] = None if not during else round(1000 * _p99(during), 3)  # type: ignore[operator]
    out["itl_samples"] = {"idle": len(idle), "during": len(during)}
    for rid in running:
        engine.abort(rid)
    engine.check_no_leaks()


def decode_main(conn: Any, result: Any, params: dict[str, Any]) -> None:
    from transfer import nccl_env

    nccl_env.set_at_process_start()
    out: dict[str, Any] = {}
    side = None
    try:
        p = params
        end = time.monotonic() + p["timeout_s"] - 5  # room to report before the driving process gives up
        for dtype, backend in PHASES:
            kv = p["kv_bytes"][dtype]
            engine = _engine(p["folder"], p["device"], dtype, p["max_model_len"], kv["decode"], p["running"] + 8)
            engine.warm_up()
            address = f"shm+ipc://{tempfile.mkdtemp(prefix='gpu-check-')}/kv.ipc"
            side = DecodeSide(conn, engine, "tcp://127.0.0.1:0" if backend == "nccl" else address, end, backend)
            side.new_engine(dtype, kv["prefill"])
            vocab = engine.model.config.vocab_size
            if dtype == "float32":
                out["exact"] = _float32_phase(side, p, vocab)
                out["exact"].update(dtype="float32", backend=backend, direct_pieces=side.receiver.direct_pieces)
            else:
                _bfloat16_phase(side, p, vocab, out)
                out["direct_pieces"] = side.receiver.direct_pieces  # > 0 on a GPU: the KV went through CUDA IPC
            side.close()
            side = None
            del engine
    except Exception:  # noqa: BLE001
        out["error"] = traceback.format_exc()[-2000:]
    finally:
        conn.send(None)
        if side is not None:
            side.close()
        result.put(out)


def run_pair(params: dict[str, Any]) -> dict[str, Any]:
    """Spawn both processes (CUDA cannot cross a fork) and wait at most ``timeout_s`` for the decode side's figures;
    both processes are gone when this returns."""
    ctx = mp.get_context("spawn")
    prefill_conn, decode_conn = ctx.Pipe()
    result = ctx.Queue()
    args = (params["folder"], params["device"], params["max_model_len"])
    prefill = ctx.Process(target=prefill_main, args=(prefill_conn, *args), daemon=True)
    decode = ctx.Process(target=decode_main, args=(decode_conn, result, params), daemon=True)
    prefill.start()
    decode.start()
    try:
        out = result.get(timeout=params["timeout_s"])
    except Exception as exc:  # noqa: BLE001 (queue.Empty: the decode side hung or died)
        out = {"error": f"no result from the decode process within {params['timeout_s']} s: {type(exc).__name__}"}
    for proc in (decode, prefill):
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    return out
