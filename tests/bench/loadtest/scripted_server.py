"""A scripted OpenAI-compatible streaming server for the load-test tests: known delays, known failures.

A raw asyncio HTTP/1.1 server in its own thread on 127.0.0.1 (port 0). Each request gets a ``Script`` from the
test's ``script(body, n)`` function (``n`` counts requests from 0): the status, the delay to the first chunk, the gap
between chunks, how many tokens and how many per chunk, whether to cut the stream or send an error event, and an
optional server ``timing`` object put in the chunk that carries ``finish_reason``, the text of each token and the
cached prompt tokens to report in ``usage``. Responses use chunked
transfer encoding, so a cut (closing without the final empty chunk) is visible to the client as a broken body.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field


@dataclass
class Script:
    status: int = 200
    ttft_s: float = 0.2
    gap_s: float = 0.05
    tokens: int | None = None  # None: the request's max_tokens
    tokens_per_chunk: int = 1
    cut_after_chunks: int | None = None  # close the connection after this many text chunks
    error_after_chunks: int | None = None  # send an error object after this many text chunks
    usage: bool = True
    timing: dict | None = None
    role_chunk: bool = True  # chat: an empty role-only chunk first
    stream: bool = True  # False: one JSON body after ttft_s, as a server that ignores stream: true
    token_text: str = " tok"  # the text of each token (a multi-turn test tells answers apart by it)
    cached_tokens: int | None = None  # reported as usage.prompt_tokens_details.cached_tokens
    extra: dict = field(default_factory=dict)


class ScriptedServer:
    def __init__(self, script=None) -> None:
        self.script = script or (lambda body, n: Script())
        self.requests: list[dict] = []
        self.gets: list[str] = []  # paths of GET requests, answered 404
        self.active = 0  # responses being written now
        self.max_active = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self.port = 0
        self.stopped = False

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ScriptedServer:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the scripted server did not start")
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()
            for task in asyncio.all_tasks(self._loop):
                task.cancel()
            self._loop.run_until_complete(asyncio.sleep(0))
            self._loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            path = lines[0].split(" ")[1]
            headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
            if lines[0].startswith("GET "):  # /status, /v1/models: not served (as another server's)
                self.gets.append(path)
                writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                await writer.drain()
                return
            body = json.loads(await reader.readexactly(int(headers.get("content-length", 0))))
            n = len(self.requests)
            self.requests.append(body | {"_path": path, "_headers": headers})
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            try:
                await self._respond(writer, path, body, self.script(body, n))
            finally:
                self.active -= 1
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _respond(self, writer, path: str, body: dict, s: Script) -> None:
        if s.status != 200:
            payload = json.dumps({"error": {"message": "scripted failure", "code": s.status}}).encode()
            writer.write(
                f"HTTP/1.1 {s.status} Error\r\nContent-Type: application/json\r\nContent-Length: "
                f"{len(payload)}\r\nConnection: close\r\n\r\n".encode()
                + payload
            )
            await writer.drain()
            return
        chat = path.endswith("/chat/completions")
        if not s.stream:
            await asyncio.sleep(s.ttft_s)
            tokens = s.tokens if s.tokens is not None else int(body.get("max_tokens", 16))
            choice = {"index": 0, "finish_reason": "length"}
            if chat:
                choice["message"] = {"role": "assistant", "content": s.token_text * tokens}
            else:
                choice["text"] = s.token_text * tokens
            usage = {"prompt_tokens": s.extra.get("prompt_tokens", 7), "completion_tokens": tokens}
            if s.cached_tokens is not None:
                usage["prompt_tokens_details"] = {"cached_tokens": s.cached_tokens}
            payload = json.dumps({"id": "x", "choices": [choice], "timing": s.timing, "usage": usage}).encode()
            writer.write(
                f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                f"{len(payload)}\r\nConnection: close\r\n\r\n".encode()
                + payload
            )
            await writer.drain()
            return
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
            b"Connection: close\r\n\r\n"
        )

        async def send(obj) -> None:
            data = ("data: " + (obj if isinstance(obj, str) else json.dumps(obj)) + "\n\n").encode()
            writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            await writer.drain()

        def chunk(text: str, finish=None) -> dict:
            choice = {"index": 0, "finish_reason": finish}
            if chat:
                choice["delta"] = {"content": text}
            else:
                choice["text"] = text
            return {"id": "x", "object": "chunk", "choices": [choice]}

        await writer.drain()
        if chat and s.role_chunk:
            await send({"id": "x", "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})
        tokens = s.tokens if s.tokens is not None else int(body.get("max_tokens", 16))
        chunks = max(1, -(-tokens // s.tokens_per_chunk))
        await asyncio.sleep(s.ttft_s)
        for i in range(chunks):
            if i:
                await asyncio.sleep(s.gap_s)
            if s.cut_after_chunks is not None and i >= s.cut_after_chunks:
                writer.transport.abort()
                return
            if s.error_after_chunks is not None and i >= s.error_after_chunks:
                await send({"error": {"message": "scripted error", "type": "server_error"}})
                break
            last = i == chunks - 1
            obj = chunk(
                s.token_text * min(s.tokens_per_chunk, tokens - i * s.tokens_per_chunk), "length" if last else None
            )
            if last and s.timing is not None:
                obj["timing"] = s.timing
            await send(obj)
        else:
            if s.usage:
                usage = {
                    "prompt_tokens": s.extra.get("prompt_tokens", 7),
                    "completion_tokens": tokens,
                    "total_tokens": tokens + 7,
                }
                if s.cached_tokens is not None:
                    usage["prompt_tokens_details"] = {"cached_tokens": s.cached_tokens}
                await send({"id": "x", "choices": [], "usage": usage})
        await send("[DONE]")
        writer.write(b"0\r\n\r\n")
        await writer.drain()
