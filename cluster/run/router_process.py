"""One router process of several serving one HTTP port (``router.processes`` > 1): the child side.

The main process's side, and the start-up and shutdown protocol, are in ``cluster/run/frontend.py``.
1. ``run_router_process`` loads the tokenizer, builds the ``Router`` and sends ``("router", event address, pid)``;
2. on ``("workers", [...])`` it registers them, binds its own ``SO_REUSEPORT`` socket on the port, runs uvicorn and
   sends ``("ready",)``;
3. ``_control`` applies what the main process sends then: pool news, ``POST /admin/scale`` answers
   (``RemoteScaler``) and ``("stop",)``. A router process whose main process is gone stops by itself.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass

from cluster.config import ClusterConfig
from cluster.routing.admission import Admission

logger = logging.getLogger(__name__)

# the Router's methods the main process calls over the pipe (membership news from the pools and the scaler)
MEMBERSHIP_METHODS = ("add_worker", "mark_dead", "drain_worker", "switch_phase", "remove_worker")
CONTROL_POLL_S = 0.1  # how often a router process looks at its pipe and at its parent (the main process's too)
ORPHAN_EXIT_S = 5.0  # a router process whose parent is gone exits this long after starting to stop, at the latest
GRACEFUL_SHUTDOWN_S = 2  # uvicorn's wait for open streams when a router process stops


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port that other SO_REUSEPORT sockets of this user may bind too (not listening;
    the main process's probe uses it too)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


@dataclass
class RouterProcessSpec:
    """Picklable: it crosses to a spawned process."""

    index: int
    config: dict  # ClusterConfig.model_dump(), the cluster secret and command-line overrides included
    model_path: str
    max_model_len: int
    event_host: str  # where the router binds its event socket (the workers connect to it)
    http_host: str
    http_port: int
    parent_pid: int
    start_timeout_s: float
    log_level: int


def run_router_process(spec: RouterProcessSpec, conn, slots) -> None:
    """The target of a spawned ``multiprocessing.Process`` (so a top-level function)."""
    logging.basicConfig(level=spec.log_level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the main process decides
    code = 1
    try:
        _serve_router(spec, conn, slots)
        code = 0
    except BaseException:
        logger.exception("router process %d failed", spec.index)
    finally:
        # skip the interpreter's teardown of torch and transformers: it takes seconds on a busy host, out of the main
        # process's shutdown budget (the app's lifespan closed the router)
        conn.close()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _serve_router(spec: RouterProcessSpec, conn, slots) -> None:
    import uvicorn

    from cluster.openai.api import create_app
    from cluster.routing.router import Router
    from engine.model_loader import load_tokenizer

    config = ClusterConfig.model_validate(spec.config)
    tokenizer = load_tokenizer(spec.model_path)
    admission = Admission(config.router.queue_size, slots, spec.index)
    max_event_bytes = config.max_event_bytes(spec.model_path, spec.max_model_len)
    router = Router(
        config, host=spec.event_host, index=spec.index, admission=admission, max_event_bytes=max_event_bytes
    )
    conn.send(("router", router.event_address, os.getpid()))
    # the main process starts the pools meanwhile (placement, then every worker's start-up: each bounded there)
    message = _receive(conn, 4 * spec.start_timeout_s, spec.parent_pid)
    if message is None or message[0] != "workers":
        return  # told to stop, or the main process is gone, before serving
    for name, role, command_address, kv_address in message[1]:
        router.add_worker(name, role, command_address, kv_address)
    router.scaler = RemoteScaler(conn)  # POST /admin/scale: the main process owns the pools
    app = create_app(router, tokenizer, config, spec.max_model_len)
    sock = reuseport_socket(spec.http_host, spec.http_port)
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, lifespan="on")
    )
    asyncio.run(_serve(server, sock, router, conn, spec.parent_pid))


def _receive(conn, timeout_s: float, parent_pid: int):
    """None when the main process is gone or says nothing within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and os.getppid() == parent_pid:
        try:
            if conn.poll(CONTROL_POLL_S):
                return conn.recv()
        except (EOFError, OSError):
            return None
    return None


async def _serve(server, sock: socket.socket, router, conn, parent_pid: int) -> None:
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not serving.done():
        await asyncio.sleep(0.02)
    if serving.done():  # it could not start: the main process sees this process exit
        await serving
        return
    conn.send(("ready",))
    control = asyncio.create_task(_control(server, router, conn, parent_pid))
    try:
        await serving
    finally:
        control.cancel()


async def _control(server, router, conn, parent_pid: int) -> None:
    while not server.should_exit:
        try:
            gone = os.getppid() != parent_pid
            while not gone and conn.poll():
                message = conn.recv()
                if message[0] in MEMBERSHIP_METHODS:
                    getattr(router, message[0])(*message[1:])
                elif message[0] == "scale_result":
                    router.scaler.answer(*message[1:])
                elif message[0] == "stop":
                    server.should_exit = True
                    break
        except (EOFError, OSError):
            gone = True
        except Exception:  # one odd message must not end the control task (the router would stop hearing news)
            logger.exception("router %d: bad message from the main process", router.index)
            gone = False
        if gone:
            logger.error("router %d: the main pdserve process is gone; stopping", router.index)
            server.should_exit = True
            timer = threading.Timer(ORPHAN_EXIT_S, os._exit, args=(1,))  # if the orderly stop hangs
            timer.daemon = True
            timer.start()
            return
        await asyncio.sleep(CONTROL_POLL_S)


class RemoteScaler:
    """A router process's stand-in for the main process's ``Scaler``, over the pipe."""

    TIMEOUT_S = 600.0  # starting workers on a cluster that must grow first can take minutes

    def __init__(self, conn) -> None:
        self._conn = conn
        self._waiting: dict[str, asyncio.Future] = {}

    async def scale_async(self, pool, replicas, drain_timeout_s=None) -> dict:
        return await self._ask("scale", pool, replicas, drain_timeout_s)

    async def switch_role_async(self, worker, to, drain_timeout_s=None, wait=False) -> dict:
        return await self._ask("switch_role", worker, to, drain_timeout_s, wait)

    async def _ask(self, method: str, *args) -> dict:
        """The main process's scaler's ``method(*args)``, over the pipe."""
        from cluster.routing.errors import ScaleError

        request_id = os.urandom(8).hex()
        future = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        try:
            self._conn.send((method, request_id, *args))
            status, body = await asyncio.wait_for(future, self.TIMEOUT_S)
        finally:
            self._waiting.pop(request_id, None)
        if status == 400:
            raise ScaleError(body["param"], body["message"])
        if status != 200:
            raise RuntimeError(body["message"])
        return body

    def answer(self, request_id: str, status: int, body: dict) -> None:
        future = self._waiting.get(request_id)
        if future is not None and not future.done():
            future.set_result((status, body))
