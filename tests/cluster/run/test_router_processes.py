"""Several router processes (``router.processes`` / ``pdserve serve --router-processes N``).

Worker side (in-process workers, two fake routers on loopback with properly sealed sockets): every event about a
request reaches only the router that sent its commands, a step's ``tokens`` message is split per router, every
router hears the heartbeats, and a silent router loses only its own requests.

Served (``pdserve serve --router-processes 2`` as a subprocess, as a user runs it): concurrent streams complete
token-exact over both processes; one 429 limit holds across them; ``/metrics`` sums them; SIGTERM stops everything
within 10 s; router processes whose main process is killed exit by themselves.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import defaultdict

import httpx
import pytest
import yaml
import zmq

from benchmarks.serve_process import process_running
from engine.config import EngineConfig
from engine.request import SamplingParams
from tests.helpers.cluster import metric_value, wait_all_kv_free
from tests.helpers.engine import Reference, random_prompts
from transfer.zap import connect_curve, plane_keys, serve_curve
from worker.messages import Abort, Command, ErrorEvent, Event, Generate, Ping, Reserve, Reserved, Stats, Tokens
from worker.protocol import Channel, Signer, Verifier, zmq_endpoint
from worker.spec import RuntimeOptions, WorkerSpec

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

SECRET = "router-processes-test-secret-0123456789"


# ---- worker side: per-router event routing ---------------------------------------------------------------------


class FakeRouters:
    """N router event sockets (PULL, verified per address) and N command senders (PUSH, sealed), on loopback."""

    def __init__(self, count: int) -> None:
        self.ctx = zmq.Context()
        self.pulls, self.addresses, self.verifiers = [], [], []
        for _ in range(count):
            sock = self.ctx.socket(zmq.PULL)
            sock.setsockopt(zmq.LINGER, 0)
            serve_curve(sock, plane_keys(SECRET))  # the workers connect as CURVE clients (transfer/zap.py)
            port = sock.bind_to_random_port("tcp://127.0.0.1")
            address = f"tcp://127.0.0.1:{port}"
            self.pulls.append(sock)
            self.addresses.append(address)
            self.verifiers.append(Verifier(SECRET, Channel.EVENTS, address))
        self.events: list[list[Event]] = [[] for _ in range(count)]
        self.pushes: list[tuple[zmq.Socket, Signer]] = []

    def connect(self, command_address: str) -> None:
        for _ in self.pulls:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            connect_curve(sock, plane_keys(SECRET))
            sock.connect(zmq_endpoint(command_address))
            self.pushes.append((sock, Signer(SECRET, Channel.COMMANDS, command_address)))

    def send(self, router: int, message: Command) -> None:
        sock, signer = self.pushes[router]
        message.router, message.sent_at = router, time.time()
        sock.send(signer.seal(message), zmq.NOBLOCK)

    def pump(self, timeout_s: float = 0.05) -> None:
        poller = zmq.Poller()
        for sock in self.pulls:
            poller.register(sock, zmq.POLLIN)
        for sock, _ in poller.poll(int(timeout_s * 1000)):
            index = self.pulls.index(sock)
            while sock.poll(0):
                self.events[index].append(self.verifiers[index].open(sock.recv()))

    def wait_for(self, condition, timeout_s: float = 30.0, ping: int | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        last_ping = 0.0
        while not condition():
            assert time.monotonic() < deadline, f"timed out; events: {[e[-5:] for e in self.events]}"
            if ping is not None and time.monotonic() - last_ping > 0.3:
                self.send(ping, Ping())
                last_ping = time.monotonic()
            self.pump()

    def of(self, router: int, kind: type) -> list:
        return [e for e in self.events[router] if isinstance(e, kind)]

    def close(self) -> None:
        for sock in self.pulls + [s for s, _ in self.pushes]:
            sock.close(0)
        self.ctx.term()


def _spec(tiny_llama_path, routers: FakeRouters, role: str, transfer=None, **runtime) -> WorkerSpec:
    engine = EngineConfig(model=str(tiny_llama_path), kv_blocks=64, torch_threads=1, max_model_len=256)
    options = RuntimeOptions(router_addresses=list(routers.addresses), secret=SECRET, **runtime)
    extra = {} if transfer is None else {"transfer": transfer}
    return WorkerSpec(name=f"{role}-0", role=role, engine=engine, runtime=options, **extra)


def _tokens_by_rid(events: list[Event]) -> dict[str, list]:
    out: dict[str, list] = defaultdict(list)
    for event in events:
        if isinstance(event, Tokens):
            for item in event.items:
                out[item.rid].append((item.token_ids, item.finish_reason))
    return out


def test_worker_sends_each_request_events_to_its_own_router(tiny_llama_path):
    from worker.colocated import ColocatedRole
    from worker.runtime import WorkerRuntime

    routers = FakeRouters(2)
    worker = WorkerRuntime(_spec(tiny_llama_path, routers, "colocated"), ColocatedRole)
    worker.start()
    try:
        routers.connect(worker.command_address)
        params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
        prompt = random_prompts(1, 12, 12, seed=3)[0]
        routers.send(0, Generate("a", prompt, params))
        routers.send(1, Generate("b", prompt, params))
        routers.send(1, Generate("c", prompt, SamplingParams(temperature=-1.0)))  # refused on receipt: an error

        def done() -> bool:
            tokens = [_tokens_by_rid(routers.events[0]), _tokens_by_rid(routers.events[1])]
            finished = all(any(f for _, f in tokens[i].get(rid, [])) for i, rid in ((0, "a"), (1, "b")))
            return finished and routers.of(1, ErrorEvent) and routers.of(0, Stats) and routers.of(1, Stats)

        routers.wait_for(done)
        routers.pump(0.5)  # anything misrouted would arrive by now
        got = [_tokens_by_rid(routers.events[0]), _tokens_by_rid(routers.events[1])]
        assert set(got[0]) == {"a"} and set(got[1]) == {"b"}  # a step's tokens message was split per router
        stream_a = [t for ids, _ in got[0]["a"] for t in ids]
        stream_b = [t for ids, _ in got[1]["b"] for t in ids]
        assert len(stream_a) == 20 and stream_a == stream_b  # same prompt, greedy: nothing lost or duplicated
        assert got[0]["a"][-1][1] == "length" and got[1]["b"][-1][1] == "length"
        assert routers.of(0, ErrorEvent) == []
        assert [(e.rid, e.code.value) for e in routers.of(1, ErrorEvent)] == [("c", "invalid_request")]
        assert {e.worker for e in routers.of(0, Stats) + routers.of(1, Stats)} == {worker.name}
        routers.wait_for(lambda: not worker.engine.requests)
        worker.engine.check_no_leaks()
    finally:
        worker.stop()
        routers.close()


def test_a_silent_router_loses_only_its_own_requests(tiny_llama_path):
    from decode.worker import DecodeRole
    from transfer.config import TransferConfig
    from worker.runtime import WorkerRuntime

    routers = FakeRouters(2)
    spec = _spec(
        tiny_llama_path, routers, "decode", transfer=TransferConfig(secret=SECRET, deadline_s=60), orphan_timeout_s=1.5
    )
    worker = WorkerRuntime(spec, DecodeRole)  # zmq over tcp, failure policy "fail", no headroom: the spec's defaults
    worker.start()
    try:
        routers.connect(worker.command_address)
        prompt = random_prompts(1, 10, 10, seed=4)[0]
        params = SamplingParams(max_tokens=4)
        routers.send(0, Reserve("d", prompt, params))
        routers.send(1, Reserve("e", prompt, params))
        routers.wait_for(lambda: routers.of(0, Reserved) and routers.of(1, Reserved), ping=1)
        assert [(e.rid, e.ok) for e in routers.of(0, Reserved)] == [("d", True)]
        assert [(e.rid, e.ok) for e in routers.of(1, Reserved)] == [("e", True)]
        # router 1 keeps pinging, router 0 says nothing: after orphan_timeout_s only "d" is freed, at router 0
        routers.wait_for(lambda: routers.of(0, ErrorEvent), timeout_s=15, ping=1)
        assert [(e.rid, e.message) for e in routers.of(0, ErrorEvent)] == [("d", "router unreachable")]
        started = time.monotonic()
        routers.wait_for(lambda: time.monotonic() - started > 2.0, ping=1)  # longer than the timeout again
        assert routers.of(1, ErrorEvent) == []
        assert set(worker.engine.requests) == {"e"}
        routers.send(1, Abort("e"))
        routers.wait_for(lambda: not worker.engine.requests, ping=1)
        worker.engine.check_no_leaks()
    finally:
        worker.stop()
        routers.close()


# ---- served: pdserve serve --router-processes 2 ----------------------------------------------------------------


def _sse_text(body: str) -> tuple[str, dict | None]:
    text, usage = "", None
    for event in body.strip().split("\n\n"):
        payload = event[len("data: ") :]
        if payload == "[DONE]":
            break
        data = json.loads(payload)
        assert "error" not in data, data
        if data.get("usage"):
            usage = data["usage"]
        for choice in data["choices"]:
            text += choice.get("text") or ""
    return text, usage


def _statuses_of_every_process(base_url: str, count: int) -> dict[int, dict]:
    """/status from each router process: new connections until every PID has answered (bounded)."""
    seen: dict[int, dict] = {}
    for _ in range(200):
        status = httpx.get(f"{base_url}/status", timeout=5, headers={"Connection": "close"}).json()
        seen[status["router"]["pid"]] = status
        if len(seen) == count:
            return seen
    raise AssertionError(f"only router processes {sorted(seen)} answered 200 connections")


@pytest.mark.e2e
def test_two_router_processes_serve_one_port(tiny_llama_path, tmp_path):
    import ray

    if ray.is_initialized():
        ray.shutdown()
    queue_size = 2
    config = tmp_path / "two-routers.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"name": str(tiny_llama_path), "max_model_len": 2048},
                "pools": {
                    "prefill": {"replicas": 1, "torch_threads": 1, "kv_blocks": 64},
                    # every request reserves its whole length: a 1,790-token one takes all 112 blocks
                    "decode": {"replicas": 1, "torch_threads": 1, "kv_blocks": 112, "reserve_headroom_tokens": 4096},
                },
                "router": {"queue_size": queue_size},
            }
        )
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "serve", "--config", str(config), "--port", "0", "--router-processes", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    worker_pids: list[int] = []
    router_pids: list[int] = []
    try:
        seen, url, deadline = [], None, time.monotonic() + 150
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            seen.append(line)
            if "workers:" in line:
                worker_pids = [int(p) for p in re.findall(r"pid (\d+)", line)]
            if "router processes:" in line:
                router_pids = [int(p) for p in re.findall(r"pid (\d+)", line)]
            if match := re.search(r"at (http://\S+)/v1", line):
                url = match.group(1)
            if "to stop" in line or (not line and proc.poll() is not None):
                break
        assert url and len(worker_pids) == 2 and len(router_pids) == 2, "".join(seen)
        assert all(process_running(p) for p in worker_pids + router_pids)
        model = str(tiny_llama_path)
        reference = Reference(tiny_llama_path)

        # 1. 16 concurrent streams, token-exact, served by both processes
        prompts = random_prompts(16, 4, 20, seed=15)
        expected = [reference.greedy(p, 12) for p in prompts]

        async def stream(client: httpx.AsyncClient, prompt: list[int]) -> tuple[int, str, dict | None]:
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": 12,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            response = await client.post(
                f"{url}/v1/completions", json=body, timeout=60, headers={"Connection": "close"}
            )
            return (
                (response.status_code, *_sse_text(response.text))
                if response.status_code == 200
                else (response.status_code, response.text, None)
            )

        async def streams(batch: list[list[int]]):
            limits = httpx.Limits(max_keepalive_connections=0)  # a new connection each: the kernel spreads them
            async with httpx.AsyncClient(limits=limits) as client:
                return await asyncio.gather(*(stream(client, p) for p in batch))

        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tiny_llama_path)
        results = asyncio.run(streams(prompts))
        for (status, text, usage), want in zip(results, expected):
            assert status == 200, text
            assert text == tokenizer.decode(want, skip_special_tokens=True)
            assert usage["completion_tokens"] == len(want)
        statuses = _statuses_of_every_process(url, 2)
        assert sorted(statuses) == sorted(router_pids)
        assert sorted(s["router"]["index"] for s in statuses.values()) == [0, 1]
        assert all(s["router"]["processes"] == 2 for s in statuses.values())
        per_process = {pid: s["router"]["requests_finished"] for pid, s in statuses.items()}
        assert sum(per_process.values()) == 16 and all(n > 0 for n in per_process.values()), per_process

        # 2. one queue limit across both: a request holds every decode block; of a burst, queue_size wait, 429 rest
        async def burst() -> list[int]:
            async with httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0)) as client:
                blocker = {
                    "model": model,
                    "prompt": random_prompts(1, 100, 100, seed=5)[0],
                    "max_tokens": 1689,
                    "ignore_eos": True,
                    "stream": True,
                }
                async with client.stream("POST", f"{url}/v1/completions", json=blocker, timeout=120) as response:
                    assert response.status_code == 200
                    lines = response.aiter_lines()
                    await lines.__anext__()  # its first token: it holds all 112 decode blocks now
                    await asyncio.sleep(0.5)  # heartbeats show the cache full
                    small = [
                        client.post(
                            f"{url}/v1/completions",
                            timeout=120,
                            headers={"Connection": "close"},
                            json={"model": model, "prompt": [5, 6, 7, 8], "max_tokens": 4},
                        )
                        for _ in range(16)
                    ]
                    answers = await asyncio.gather(*small)
                    async for _ in lines:
                        pass
                return [r.status_code for r in answers]

        codes = asyncio.run(burst())
        assert sorted(codes) == [200] * queue_size + [429] * (16 - queue_size), codes

        # 3. /metrics sums both processes
        wait_all_kv_free(url)
        finished = 16 + 1 + queue_size
        assert metric_value(url, "pdserve_requests_total", outcome="finished") == finished
        assert metric_value(url, "pdserve_requests_total", outcome="error") == 16 - queue_size
        assert metric_value(url, "pdserve_router_inflight") == 0
        assert metric_value(url, "pdserve_worker", worker="decode-0", key="total_blocks") == 112  # not 2 x 112
        per_process = {pid: s["router"]["requests_finished"] for pid, s in _statuses_of_every_process(url, 2).items()}
        assert sum(per_process.values()) == finished

        # 4. SIGTERM: everything gone within 10 s
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        assert time.monotonic() - started < 10.0
        time.sleep(0.5)
        assert [p for p in worker_pids + router_pids if process_running(p)] == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        for pid in worker_pids + router_pids:
            if process_running(pid):
                os.kill(pid, signal.SIGKILL)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # Ray's processes left in the group this test created
        except OSError:
            pass


ROUTERS_ONLY_SCRIPT = textwrap.dedent("""
    import sys, time
    from cluster.config import parse_config
    from cluster.run.frontend import RouterProcesses
    from cluster.run.router_process import reuseport_socket
    from cluster.run.launch import with_cluster_secret

    config = with_cluster_secret(parse_config({"model": {"name": sys.argv[1], "max_model_len": 256},
                                               "router": {"processes": 2}}))
    probe = reuseport_socket("127.0.0.1", 0)
    port = probe.getsockname()[1]
    routers = RouterProcesses(config, sys.argv[1], 256, "127.0.0.1", "127.0.0.1", port)
    routers.serve([])
    probe.close()
    # what the pool monitor does when Ray restarts a worker, then when one dies
    routers.add_worker_threadsafe("decode-7", "decode", "tcp://127.0.0.1:9", None)
    routers.mark_dead_threadsafe("decode-7", "gone in this test")
    print("routers", port, *routers.pids, flush=True)
    time.sleep(120)
""")


def test_router_processes_hear_the_monitor_and_exit_when_the_main_process_dies(tiny_llama_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", ROUTERS_ONLY_SCRIPT, str(tiny_llama_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not pids and proc.poll() is None:
            started = [line.split() for line in list(lines) if line.startswith("routers ")]
            if started:
                port, pids = int(started[0][1]), [int(p) for p in started[0][2:]]
            time.sleep(0.05)
        assert len(pids) == 2 and all(process_running(p) for p in pids), "".join(lines)
        # both processes registered the worker and marked it dead, each when told (not by a missed heartbeat)
        deadline = time.monotonic() + 10  # the news reaches each process within its next poll of the pipe
        while not all(
            [w["name"] for w in s["workers"]] == ["decode-7"]
            for s in _statuses_of_every_process(f"http://127.0.0.1:{port}", 2).values()
        ):
            assert time.monotonic() < deadline, "".join(lines)
            time.sleep(0.05)
        while sum("worker decode-7 marked dead: gone in this test" in line for line in list(lines)) < 2:
            assert time.monotonic() < deadline, "".join(lines)
            time.sleep(0.05)

        proc.kill()  # no chance to stop anything
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(process_running(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [p for p in pids if process_running(p)] == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        for pid in pids:
            if process_running(pid):
                os.kill(pid, signal.SIGKILL)
