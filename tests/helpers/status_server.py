"""A stand-in for a running router's ``GET /status``: a canned answer over real HTTP, for testing ``pdserve status``
without starting a cluster (the real router's answer is tested in tests/cluster/run/test_serve_cli.py)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def canned_status() -> dict[str, Any]:
    """A ``/status`` answer shaped like ``cluster/routing/router.py`` ``status()``: one worker with heartbeat figures, one that
    has not sent its first heartbeat yet (so it has no load fields), two router processes."""
    return {
        "mode": "disaggregated",
        "model": "tiny-llama",
        "inflight": 3,
        "queue_depth": 1,
        "router": {"index": 0, "pid": 4242, "processes": 2, "queue_depth_all": 2, "requests_finished": 17.0},
        "workers": [
            {
                "name": "prefill-0",
                "role": "prefill",
                "alive": True,
                "inflight": 1,
                "last_seen_s": 0.2,
                "stats_age_s": 0.2,
                "address": "tcp://127.0.0.1:5555",
                "degraded": False,
                "loop_age_s": 0.01,
                "waiting": 2,
                "running": 1,
                "free_blocks": 80,
                "total_blocks": 96,
                "transfers_ok": 5.0,
                "transfer_bytes": 123456.0,
            },
            {
                "name": "decode-0",
                "role": "decode",
                "alive": False,
                "inflight": 0,
                "last_seen_s": 9.5,
                "stats_age_s": None,
            },
        ],
    }


class StatusServer:
    """Serves ``payload`` at ``/status`` on 127.0.0.1 (a free port) from a thread; ``api_key`` makes it answer 401
    without ``Authorization: Bearer <key>``; ``delay_s`` holds each answer that long. Use as a context manager."""

    def __init__(self, payload: dict[str, Any], api_key: str | None = None, delay_s: float = 0.0) -> None:
        self.payload = payload
        self.api_key = api_key
        self.delay_s = delay_s
        self.authorizations: list[str | None] = []  # the Authorization header of each request, in order
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="status-server", daemon=True
        )

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                owner.authorizations.append(self.headers.get("Authorization"))
                time.sleep(owner.delay_s)
                if self.path != "/status":
                    self._answer(404, {"error": {"message": "not found", "code": "not_found"}})
                elif owner.api_key and self.headers.get("Authorization") != f"Bearer {owner.api_key}":
                    self._answer(401, {"error": {"message": "invalid API key", "code": "invalid_api_key"}})
                else:
                    self._answer(200, owner.payload)

            def _answer(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up first (its --timeout)
                    pass

            def log_message(self, *args: Any) -> None:  # keep the test output clean
                pass

        return Handler

    def __enter__(self) -> StatusServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
