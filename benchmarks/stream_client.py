"""A token-timed client of the OpenAI completions endpoint: each request's tokens as its client saw them, with the time
each was read (``logprobs: 0`` makes every chunk name its tokens, so tokens are counted, not guessed from text).

``Client.start`` sends ``Stream``s in order from an event loop on a thread of its own (streamed or not, optionally a
fixed gap apart); the caller reads them meanwhile (they only grow) and ``join``s. Used by ``pdserve bench migrate``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class Stream:
    """One request as its client saw it. ``arrivals[i]``: ``time.perf_counter()`` when token i's chunk was read."""

    index: int
    prompt: str
    max_tokens: int
    sent_s: float | None = None
    request_id: str | None = None
    arrivals: list[float] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)
    text: str = ""
    chunks: int = 0
    completion_tokens: int | None = None  # the final usage
    finish_reason: str | None = None
    timing: dict = field(default_factory=dict)  # the router's, from the last chunk
    error: str | None = None

    @property
    def ended(self) -> bool:
        return self.finish_reason is not None or self.error is not None


def request_body(model: str, stream: Stream, streamed: bool) -> dict:
    body: dict[str, Any] = {
        "model": model,
        "prompt": stream.prompt,
        "max_tokens": stream.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,  # each chunk lists its tokens: tokens are counted, not guessed from text
        "stream": streamed,
    }
    if streamed:
        body["stream_options"] = {"include_usage": True}
    return body


def apply_chunk(stream: Stream, chunk: dict, now: float) -> None:
    """A streamed chunk, or a whole non-streamed response, read at ``now``."""
    if chunk.get("error"):
        stream.error = json.dumps(chunk["error"])[:300]
        return
    stream.request_id = stream.request_id or chunk.get("id")
    if chunk.get("usage"):
        stream.completion_tokens = chunk["usage"].get("completion_tokens")
    if isinstance(chunk.get("timing"), dict):
        stream.timing = chunk["timing"]
    for choice in chunk.get("choices") or []:
        tokens = (choice.get("logprobs") or {}).get("tokens") or []
        if tokens:
            stream.tokens += tokens
            stream.arrivals += [now] * len(tokens)
            stream.chunks += 1
        stream.text += choice.get("text") or ""
        if choice.get("finish_reason"):
            stream.finish_reason = choice["finish_reason"]


async def _send(client: httpx.AsyncClient, url: str, model: str, stream: Stream, streamed: bool) -> None:
    stream.sent_s = time.perf_counter()
    body = request_body(model, stream, streamed)
    try:
        if not streamed:
            response = await client.post(url, json=body)
            if response.status_code != 200:
                stream.error = f"http {response.status_code}: {response.text[:300]}"
            else:
                apply_chunk(stream, response.json(), time.perf_counter())
            return
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                stream.error = f"http {response.status_code}: {(await response.aread())[:300]!r}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                apply_chunk(stream, json.loads(line[len("data: ") :]), time.perf_counter())
        if stream.finish_reason is None and stream.error is None:
            stream.error = "the stream ended without a finish reason"
    except (httpx.HTTPError, ValueError) as exc:
        stream.error = f"{type(exc).__name__}: {exc}"[:300]


class Client:
    """Sends requests in order from an event loop on a thread of its own; the caller reads the ``Stream``s meanwhile
    (they only grow) and ``join``s."""

    def __init__(self, base_url: str, model: str, timeout_s: float) -> None:
        self.url = f"{base_url}/v1/completions"
        self.model = model
        self.timeout_s = timeout_s
        self._thread: threading.Thread | None = None

    def start(self, streams: Sequence[Stream], streamed: bool = True, gap_s: float = 0.0) -> None:
        async def send_all() -> None:
            limits = httpx.Limits(max_connections=len(streams) + 1, max_keepalive_connections=len(streams) + 1)
            async with httpx.AsyncClient(timeout=self.timeout_s, limits=limits) as client:
                tasks = []
                for i, stream in enumerate(streams):
                    if i and gap_s:
                        await asyncio.sleep(gap_s)
                    tasks.append(asyncio.create_task(_send(client, self.url, self.model, stream, streamed)))
                await asyncio.gather(*tasks)

        self._thread = threading.Thread(target=asyncio.run, args=(send_all(),), name="bench-stream-client", daemon=True)
        self._thread.start()

    def join(self, timeout_s: float) -> None:
        assert self._thread is not None
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise RuntimeError(f"the requests did not end within {timeout_s:.0f} s")
