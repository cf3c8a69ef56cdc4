"""A fault stays with the request that caused it, as a client of the served cluster sees it (both modes).

A temperature so small that dividing by it overflows is greedy; a request whose logits go non-finite, or whose forward
raises, gets an explicit error (an error event in a stream, a 5xx OpenAI error body otherwise) while a concurrent
request finishes token-exact; the worker keeps serving and holds nothing afterwards. The workers run as threads in
this process (``in_process=True``) so faults can be injected into their engines.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from cluster.run.launch import start_serving
from tests.helpers.cluster import tiny_cluster_config, wait_all_kv_free

pytestmark = pytest.mark.timeout(240)

MARK = 4242  # the seed that marks the request a fault is injected for (greedy requests do not use it)
NORMAL_PROMPT, NORMAL_TOKENS = "a normal request", 24


@pytest.fixture(params=["disaggregated", "colocated"])
def handle(request, tiny_llama_path):
    handle = start_serving(tiny_cluster_config(tiny_llama_path, request.param), in_process=True)
    try:
        yield handle
    finally:
        try:
            wait_all_kv_free(handle.base_url)
        finally:
            handle.stop()


def _body(handle, prompt: str, max_tokens: int, **extra) -> dict:
    return {
        "model": handle.config.served_model_name,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


def _complete(handle, prompt=NORMAL_PROMPT, max_tokens=NORMAL_TOKENS, **extra) -> httpx.Response:
    return httpx.post(f"{handle.base_url}/v1/completions", json=_body(handle, prompt, max_tokens, **extra), timeout=60)


def _stream_events(handle, prompt: str, max_tokens: int, **extra) -> tuple[int, list]:
    """A streamed completion: its HTTP status and its events (parsed JSON, or the final "[DONE]"); an error before
    the stream began is one event, the error body."""
    body = _body(handle, prompt, max_tokens, stream=True, **extra)
    with httpx.stream("POST", f"{handle.base_url}/v1/completions", json=body, timeout=60) as response:
        if response.status_code != 200:
            response.read()
            return response.status_code, [response.json()]
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        return response.status_code, [e if e == "[DONE]" else json.loads(e) for e in events]


def _sampling_workers(handle) -> list:
    """The workers whose engines sample after the first token: decode workers, or every colocated worker."""
    return [r.actor.worker for r in handle.workers if r.role in ("decode", "colocated")]


class Concurrent:
    """A normal streamed request running on a thread; ``started`` is set once its first token has arrived."""

    def __init__(self, handle) -> None:
        self.handle, self.started, self.text, self.error = handle, threading.Event(), "", None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.started.wait(60), "the concurrent request never produced a token"

    def _run(self) -> None:
        body = _body(self.handle, NORMAL_PROMPT, NORMAL_TOKENS, stream=True)
        try:
            with httpx.stream("POST", f"{self.handle.base_url}/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.error = event["error"]
                    else:
                        self.text += event["choices"][0]["text"]
                        self.started.set()
        except Exception as exc:  # noqa: BLE001 - reported by result()
            self.error = repr(exc)
        finally:
            self.started.set()

    def result(self) -> str:
        self.thread.join(60)
        assert not self.thread.is_alive() and self.error is None, self.error
        return self.text


def test_tiny_temperature_is_greedy_and_the_next_request_is_served(handle):
    expected = _complete(handle)
    assert expected.status_code == 200
    odd = _complete(handle, temperature=1e-40)
    assert odd.status_code == 200, odd.text
    assert odd.json()["choices"][0]["text"] == expected.json()["choices"][0]["text"]  # below 1e-5 is greedy
    after = _complete(handle)
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == expected.json()["choices"][0]["text"]
    wait_all_kv_free(handle.base_url)


def _poison_marked_rows(worker) -> None:
    """From its second token on, the marked request's logits row is NaN (the rest of the batch is untouched)."""
    engine = worker.engine
    original = engine.runner.execute

    def execute(chunks):
        logits, stats = original(chunks)
        rows = [c.request for c in chunks if c.samples]
        marked = [i for i, r in enumerate(rows) if r.params.seed == MARK and r.output_token_ids]
        if marked:
            logits = logits.clone()  # an inference tensor: edited here, it needs a copy
            logits[marked] = float("nan")
        return logits, stats

    engine.runner.execute = execute


def test_non_finite_logits_fail_only_that_request(handle):
    expected = _complete(handle).json()["choices"][0]["text"]
    for worker in _sampling_workers(handle):
        _poison_marked_rows(worker)
    normal = Concurrent(handle)
    status, events = _stream_events(handle, "poisoned", 16, seed=MARK)
    errors = [e["error"] for e in events if e != "[DONE]" and "error" in e]
    assert status == 200 and events[-1] == "[DONE]"
    assert len(errors) == 1 and errors[0]["code"] == "sampling_error" and "not finite" in errors[0]["message"]
    response = _complete(handle, "poisoned", 16, seed=MARK)
    assert response.status_code >= 500 and response.json()["error"]["code"] == "sampling_error"
    assert normal.result() == expected
    assert _complete(handle).json()["choices"][0]["text"] == expected
    wait_all_kv_free(handle.base_url)


def _fail_marked_forwards(handle) -> None:
    """Any forward holding the marked request raises: in the prefill engine's layer hook (fault injection; it runs
    inside the forward that streams the KV) when prefill is disaggregated, else in the colocated workers' forward."""
    for replica in handle.workers:
        worker = replica.actor.worker
        if replica.role == "prefill":

            def failing_hook(layer, batch):
                if any(c.request.params.seed == MARK for c in batch.chunks):
                    raise RuntimeError("injected device fault")

            worker.engine.set_layer_hook(failing_hook)
        elif replica.role == "colocated":
            original = worker.engine.runner.execute

            def execute(chunks, original=original):
                if any(c.request.params.seed == MARK for c in chunks):
                    raise RuntimeError("injected device fault")
                return original(chunks)

            worker.engine.runner.execute = execute


def test_failed_forward_fails_that_request_and_the_worker_goes_on(handle):
    expected = _complete(handle).json()["choices"][0]["text"]
    _fail_marked_forwards(handle)
    # the concurrent request decodes on the decode worker (disaggregated) or on one colocated worker: the marked
    # requests go to the idle one (least loaded), so no forward holds both
    normal = Concurrent(handle)
    for stream in (False, True):
        if stream:
            status, events = _stream_events(handle, "doomed", 8, seed=MARK)
            assert status >= 500  # it failed before its first token: a proper HTTP error, not a broken stream
            error = events[0]["error"]
        else:
            response = _complete(handle, "doomed", 8, seed=MARK)
            assert response.status_code >= 500
            error = response.json()["error"]
        assert error is not None and error["code"] == "worker_error"
        assert "RuntimeError" in error["message"] and "injected device fault" in error["message"]
    assert normal.result() == expected
    # the worker keeps serving: the failed requests left nothing queued behind them
    for _ in range(2):
        response = _complete(handle)
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == expected
    status = wait_all_kv_free(handle.base_url)
    assert sum(w.get("errors", 0) for w in status["workers"]) >= 2  # counted where they happened
