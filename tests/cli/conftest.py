from __future__ import annotations

import pytest

from tests.helpers.status_server import StatusServer, canned_status


@pytest.fixture
def status_server():
    """``status_server(api_key=None, delay_s=0.0)``: a running stand-in router serving ``canned_status()``."""
    servers: list[StatusServer] = []

    def start(api_key: str | None = None, delay_s: float = 0.0) -> StatusServer:
        server = StatusServer(canned_status(), api_key=api_key, delay_s=delay_s).__enter__()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.__exit__(None, None, None)
