"""gpu-check's prefill/decode pair: two processes on one device over the same-node transfer path (the shm backend).

Each process runs what a worker runs, without its sockets or Ray: an ``LLMEngine`` and a transfer endpoint, glued the
way prefill/worker.py and decode/worker.py glue them (the prefill side's KV sink maps logical blocks to the decode
side's reserved ones and calls ``send_layer``; the decode side's receiver writes through ``engine.write_remote_kv``,
``remote_first_token`` and ``remote_kv_done`` admit the request). The decode process drives; the prefill process
answers over a multiprocessing pipe with each request's first token.

Three figures:
- **exact**: greedy tokens of prompts prefilled there and decoded here, against the same engine here generating them
  alone (the colocated path): token-exact, first token included.
- **transfer GB/s**: a long prompt's KV bytes over the time from the prefill side's first ``send_layer`` to the
  receiver's DONE (perf_counter is one clock for both processes on Linux). The KV is sent after the whole prefill
  (stream_kv off), so the window holds the transfer, not the prefill's compute on the shared device.
- **inter-token latency**: ``running`` requests decode here; the intervals between their steps are recorded idle, and
  again for the steps that overlap a long prompt's KV arriving (first piece written to DONE): p99 of each.
"""

from __future__ import annotations

import multiprocessing as mp
import tempfile
import time
import traceback
from typing import Any

SECRET = "gpu-check-pair-secret-0123456789"
WAIT_S = 120.0  # any single wait on the other process


def _engine(folder: str, device: str, dtype: str, max_model_len: int, kv_bytes: int, max_num_seqs: int):
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
        )
    )


def _greedy(max_tokens: int):
    from engine.request import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def prefill_main(conn: Any, folder: str, device: str, dtype: str, max_model_len: int, kv_bytes: int) -> None:
    """The prefill process: (rid, prompt, dst_blocks, address, stream) in; (rid, first token, first send) out."""
    from engine.request import FinishReason
    from transfer.base import TransferConfig, make_sender
    from transfer.wire import ModelFingerprint

    sender = None
    try:
        engine = _engine(folder, device, dtype, max_model_len, kv_bytes, 8)
        engine.warm_up()
        sender = make_sender("shm", ModelFingerprint.from_spec(engine.kv_spec), TransferConfig(secret=SECRET))
        conn.send(("ready",))
        first_send: dict[str, float] = {}
        while True:
            if conn.poll(0.001):
                msg = conn.recv()
                if msg is None:
                    break
                rid, prompt, dst, address, stream = msg

                def sink(ready, rid=rid, dst=dst):
                    first_send.setdefault(rid, time.perf_counter())
                    sender.send_layer(rid, ready.layer, dst[ready.first_block : ready.end_block], ready.k, ready.v)

                engine.add_request(prompt, _greedy(1), rid, prefill_only=True, kv_sink=sink, stream_kv=stream)
                sender.begin(rid, address)
            for output in engine.step() if engine.has_unfinished() else []:
                if output.finish_reason is FinishReason.PREFILLED:
                    sender.finish(output.request_id)
                    conn.send((output.request_id, output.new_token_ids[0], first_send.pop(output.request_id)))
                elif output.error is not None:
                    conn.send((output.request_id, None, output.error))
            for event in sender.poll():  # the lease ended (acked or failed): the blocks are free to go
                if event.transfer_id in engine.requests:
                    engine.release(event.transfer_id)
        engine.check_no_leaks()
    except Exception:  # noqa: BLE001 (reported to the driving process, which puts it in the JSON)
        conn.send(("error", traceback.format_exc()[-2000:]))
    finally:
        if sender is not None:
            sender.close()


class DecodeSide:
    """The decode process's engine and receiver; ``tick`` is one turn of a decode worker's loop."""

    def __init__(self, conn: Any, engine: Any, address: str) -> None:
        from transfer.base import TransferConfig, make_receiver
        from transfer.wire import ModelFingerprint

        self.conn, self.engine = conn, engine
        self.first_write: dict[str, float] = {}
        self.done: dict[str, float] = {}
        self.firsts: dict[str, tuple[int, float]] = {}
        self.tokens: dict[str, list[int]] = {}
        # while set, first tokens wait here instead of admitting their request: the steps measured while a long
        # prompt's KV arrives then never include that request's own admission and first decode (a new context size)
        self.hold_first_tokens = False
        self.held: dict[str, int] = {}
        config = TransferConfig(secret=SECRET, kv_device=engine.config.device)
        fingerprint = ModelFingerprint.from_spec(engine.kv_spec)
        self.receiver = make_receiver("shm", fingerprint, self._sink, address, config)

    def _sink(self, rid: str, layer: int, blocks: list[int], k: Any, v: Any) -> None:
        self.first_write.setdefault(rid, time.perf_counter())
        self.engine.write_remote_kv(rid, layer, blocks, k, v)

    def send(self, rid: str, prompt: list[int], max_tokens: int, stream: bool) -> None:
        blocks = self.engine.reserve_remote(prompt, _greedy(max_tokens), rid)
        if blocks is None:
            raise RuntimeError(f"no KV blocks free for {rid}")
        missing = self.engine.missing_prompt_blocks(self.engine.requests[rid])
        self.receiver.expect(rid, missing, num_layers=self.engine.kv_spec.num_layers)
        self.tokens[rid] = []
        self.conn.send((rid, prompt, missing, self.receiver.address, stream))

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
                self.engine.remote_first_token(rid, token)
        for event in self.receiver.poll():
            if not event.ok:
                raise RuntimeError(f"transfer {event.transfer_id} failed: {event.error!r}")
            self.done[event.transfer_id] = time.perf_counter()
            self.engine.remote_kv_done(event.transfer_id)
        if not self.engine.has_unfinished():
            self.receiver.wait(0.001)
            return None
        outputs = self.engine.step()
        for output in outputs:
            if output.request_id in self.tokens:
                self.tokens[output.request_id].extend(output.new_token_ids)
        return time.perf_counter() if any(o.new_token_ids for o in outputs) else None

    def run_until(self, condition: Any, what: str) -> None:
        end = time.monotonic() + WAIT_S
        while not condition():
            if time.monotonic() > end:
                raise TimeoutError(f"timed out waiting for {what}")
            self.tick()


def _p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]


def decode_main(conn: Any, result: Any, params: dict[str, Any]) -> None:
    from bench.gpu_check_models import random_prompts

    out: dict[str, Any] = {}
    side = None
    try:
        p = params
        engine = _engine(p["folder"], p["device"], p["dtype"], p["max_model_len"], p["kv_bytes"], p["running"] + 8)
        engine.warm_up()
        side = DecodeSide(conn, engine, f"shm+ipc://{tempfile.mkdtemp(prefix='gpu-check-')}/kv.ipc")
        ready = conn.recv() if conn.poll(WAIT_S) else ("timeout",)
        if ready[0] != "ready":
            raise RuntimeError(f"prefill process did not start: {ready}")
        vocab = engine.model.config.vocab_size

        # 1. token-exact against this engine alone
        prompts = random_prompts(p["exact_prompts"], p["exact_prompt_len"], vocab, seed=11)
        reference = [r.token_ids for r in engine.generate(prompts, _greedy(p["exact_tokens"]))]
        engine.block_manager.reset_prefix_cache()
        rids = [f"exact-{i}" for i in range(len(prompts))]
        for rid, prompt in zip(rids, prompts):
            side.send(rid, prompt, p["exact_tokens"], stream=True)
        side.run_until(lambda: all(r not in engine.requests for r in rids), "the exactness requests")
        ours = [side.tokens[r] for r in rids]
        out["exact"] = {"rows": len(rids), "exact_rows": sum(a == b for a, b in zip(reference, ours))}
        out["exact"]["exact"] = out["exact"]["exact_rows"] == len(rids)

        # 2 and 3. running decodes, idle ITL, then ITL while long prompts' KV arrives, and its GB/s
        running = [f"run-{i}" for i in range(p["running"])]
        for rid, prompt in zip(running, random_prompts(len(running), 64, vocab, seed=12)):
            engine.add_request(prompt, _greedy(p["max_model_len"] - 128), rid)
        stamps: list[float] = []
        side.run_until(lambda: all(engine.requests[r].output_token_ids for r in running), "running decodes")
        while len(stamps) < p["idle_steps"]:
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
                stamp = side.tick()
                if stamp is not None:
                    steps.append(stamp)
                if time.perf_counter() - steps[0] > WAIT_S:
                    raise TimeoutError(f"{rid}: KV never completed")
            start, end = side.first_write[rid], side.done[rid]
            during += [b - a for a, b in zip(steps, steps[1:]) if b > start and a < end]
            sent = side.firsts[rid][1] if rid in side.firsts else None
            nbytes = len(prompt) * engine.kv_spec.bytes_per_block // engine.kv_spec.block_size
            if sent is not None:
                rates.append(nbytes / max(end - sent, 1e-9) / 1e9)
            side.hold_first_tokens = False
            engine.remote_first_token(rid, side.held.pop(rid))
            side.run_until(lambda rid=rid: rid not in engine.requests, f"{rid} to finish")
        out["transfer_gbps"] = float(f"{sorted(rates)[len(rates) // 2]:.4g}") if rates else None
        out["kv_bytes_per_long_prompt"] = (
            p["long_prompt_len"] * engine.kv_spec.bytes_per_block // engine.kv_spec.block_size
        )
        out["itl_idle_p99_ms"] = None if not idle else round(1000 * _p99(idle), 3)
        out["itl_during_p99_ms"] = None if not during else round(1000 * _p99(during), 3)
        out["itl_samples"] = {"idle": len(idle), "during": len(during)}
        for rid in running:
            engine.abort(rid)
        engine.check_no_leaks()
    except Exception:  # noqa: BLE001
        out["error"] = traceback.format_exc()[-2000:]
    finally:
        conn.send(None)
        if side is not None:
            side.receiver.close()
        result.put(out)


def run_pair(params: dict[str, Any]) -> dict[str, Any]:
    """Start the two processes (spawn: CUDA cannot cross a fork), wait for the decode side's figures."""
    ctx = mp.get_context("spawn")
    prefill_conn, decode_conn = ctx.Pipe()
    result = ctx.Queue()
    args = (params["folder"], params["device"], params["dtype"], params["max_model_len"], params["kv_bytes"])
    prefill = ctx.Process(target=prefill_main, args=(prefill_conn, *args), daemon=True)
    decode = ctx.Process(target=decode_main, args=(decode_conn, result, params), daemon=True)
    prefill.start()
    decode.start()
    try:
        out = result.get(timeout=params.get("timeout_s", 300))
    except Exception as exc:  # noqa: BLE001 (queue.Empty: the decode side hung or died)
        out = {"error": f"no result from the decode process: {type(exc).__name__}"}
    for proc in (decode, prefill):
        proc.join(15)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    return out
