"""Several router processes serving one HTTP port (``router.processes`` > 1): the main process's side (the design:
docs/architecture.md, "Several router processes"; the child side: cluster/run/router_process.py).

1. A ``SO_REUSEPORT`` probe socket holds the port (never listening) until every router process listens on it.
2. N router processes spawn with ``PROMETHEUS_MULTIPROC_DIR`` set and report their event addresses; the pools start
   with all of them, and each worker answers only the router that owns a request (its commands carry its index).
3. Each router process gets ``("workers", [...])`` and answers ``("ready",)``. Membership news then goes down every
   pipe; ``("scale", ...)`` comes up to the main process, which owns the pools, and goes back as ``scale_result``.
Shutdown: ``("stop",)`` on each pipe, then SIGKILL, within the caller's budget.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from typing import TYPE_CHECKING

from cluster.config import ClusterConfig
from cluster.routing.admission import release_slot
from cluster.run.router_process import CONTROL_POLL_S, RouterProcessSpec, run_router_process

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.context import SpawnProcess

logger = logging.getLogger(__name__)


class RouterProcesses:
    """The main process's handle on its router processes; stands in for the router the pool monitor reports to."""

    def __init__(
        self,
        config: ClusterConfig,
        model_path: str,
        max_model_len: int,
        event_host: str,
        http_host: str,
        http_port: int,
    ) -> None:
        self.count = config.router.processes
        self._ctx = multiprocessing.get_context("spawn")
        self._slots = self._ctx.Array("i", self.count)  # admission: one slot per router process
        self._timeout_s = config.ray.start_timeout_s
        self._lock = threading.Lock()  # pipes are written from the monitor thread and the main thread
        self._stopping = threading.Event()
        self.metrics_dir = tempfile.mkdtemp(prefix="pdserve-metrics-")
        self.pids: list[int] = []
        self.event_addresses: list[str] = []
        self._conns: list[Connection] = []
        self._procs: list[SpawnProcess] = []
        spec = RouterProcessSpec(
            0, config.model_dump(), model_path, max_model_len, event_host, http_host, http_port, os.getpid(),
            self._timeout_s, logging.getLogger().level,
        )  # fmt: skip
        try:
            self._spawn(spec)
            for index in range(self.count):
                _, address, pid = self._expect(index, "router")
                self.event_addresses.append(address)
                self.pids.append(pid)
        except BaseException:
            self.stop(timeout_s=3.0)
            raise

    def _spawn(self, spec: RouterProcessSpec) -> None:
        previous = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = self.metrics_dir  # read by prometheus_client as the child imports it
        try:
            for index in range(self.count):
                ours, theirs = self._ctx.Pipe(duplex=True)
                args = (dataclasses.replace(spec, index=index), theirs, self._slots)
                proc = self._ctx.Process(
                    target=run_router_process, args=args, name=f"pdserve-router-{index}", daemon=True
                )
                proc.start()
                theirs.close()
                self._conns.append(ours)
                self._procs.append(proc)
        finally:
            if previous is None:
                os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
            else:
                os.environ["PROMETHEUS_MULTIPROC_DIR"] = previous

    def _expect(self, index: int, kind: str) -> tuple:
        """The next message of router process ``index``, which must be ``kind``; RuntimeError if it exits or is
        silent past the start timeout."""
        conn, proc = self._conns[index], self._procs[index]
        deadline = time.monotonic() + self._timeout_s
        while time.monotonic() < deadline:
            try:
                if conn.poll(0.2):
                    message = conn.recv()
                    if message[0] == kind:
                        return message
                    raise RuntimeError(f"router process {index} sent {message[0]!r} instead of {kind!r}")
            except (EOFError, OSError):
                pass  # it died: reported below
            if not proc.is_alive():
                raise RuntimeError(f"router process {index} exited during start-up (exit code {proc.exitcode})")
        raise RuntimeError(f"router process {index} did not start within {self._timeout_s:.0f} s")

    def serve(self, workers: list[tuple[str, str, str, str | None]]) -> None:
        """Give every router process the workers, and wait until each accepts connections."""
        for index in range(self.count):
            self._send(index, ("workers", workers))
        for index in range(self.count):
            self._expect(index, "ready")
        threading.Thread(target=self._watch, name="pdserve-router-watch", daemon=True).start()

    def _send(self, index: int, message: tuple) -> bool:
        with self._lock:
            try:
                self._conns[index].send(message)
                return True
            except (OSError, ValueError):  # that process is gone (its pipe is broken or closed)
                return False

    def _broadcast(self, message: tuple) -> None:
        for index in range(self.count):
            self._send(index, message)

    # the pool monitor calls these from its thread, as it would an in-process router's
    def add_worker_threadsafe(
        self,
        name: str,
        role: str,
        command_address: str,
        kv_address: str | None = None,
        switch_result: str | None = None,
    ) -> None:
        self._broadcast(("add_worker", name, role, command_address, kv_address, switch_result))

    def mark_dead_threadsafe(self, name: str, reason: str) -> None:
        self._broadcast(("mark_dead", name, reason))

    # live resizing (cluster/run/scaling.py) calls these
    def drain_worker_threadsafe(self, name: str, deadline_s: float, switch_to: str | None = None) -> None:
        self._broadcast(("drain_worker", name, deadline_s, switch_to))

    def switch_phase_threadsafe(self, name: str, phase: str) -> None:
        self._broadcast(("switch_phase", name, phase))

    def remove_worker_threadsafe(self, name: str) -> None:
        self._broadcast(("remove_worker", name))

    def serve_scaling(self, scaler) -> None:
        threading.Thread(
            target=self._scale_requests, args=(scaler,), name="pdserve-scale-requests", daemon=True
        ).start()

    def _scale_requests(self, scaler) -> None:
        while not self._stopping.wait(CONTROL_POLL_S):
            for index, conn in enumerate(self._conns):
                try:
                    while conn.poll():
                        message = conn.recv()
                        if message[0] in ("scale", "switch_role"):  # the Scaler's methods
                            threading.Thread(target=self._scale, args=(scaler, index, *message), daemon=True).start()
                except (EOFError, OSError):
                    continue  # that router process is gone: _watch reports it

    def _scale(self, scaler, index: int, method: str, request_id: str, *args) -> None:
        from cluster.routing.errors import ScaleError

        try:
            result: tuple = (200, getattr(scaler, method)(*args))
        except ScaleError as exc:
            result = (400, {"param": exc.param, "message": str(exc)})
        except Exception as exc:  # the router process answers 500 with it rather than waiting forever
            logger.exception("scale request failed")
            result = (500, {"param": None, "message": f"{type(exc).__name__}: {exc}"})
        self._send(index, ("scale_result", request_id, *result))

    def _watch(self) -> None:
        """A dead router process's queue places are given back; the others go on (the workers free its requests
        after ``orphan_timeout_s``)."""
        from prometheus_client import multiprocess

        reported: set[int] = set()
        while not self._stopping.wait(1.0):
            for index, proc in enumerate(self._procs):
                if index in reported or proc.is_alive():
                    continue
                reported.add(index)
                logger.error(
                    "router process %d (pid %s) exited (exit code %s); %d of %d still serve",
                    index,
                    proc.pid,
                    proc.exitcode,
                    sum(p.is_alive() for p in self._procs),
                    self.count,
                )
                release_slot(self._slots, index)
                multiprocess.mark_process_dead(proc.pid, self.metrics_dir)  # its in-flight gauges no longer count

    def alive(self) -> list[int]:
        return [proc.pid for proc in self._procs if proc.is_alive() and proc.pid is not None]

    def stop(self, timeout_s: float) -> bool:
        """Ask, then SIGKILL what is left after ``timeout_s``; False if any was killed."""
        deadline = time.monotonic() + timeout_s
        self._stopping.set()
        self._broadcast(("stop",))
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic() - 0.5))
        clean = not self.alive()
        self.kill()
        for proc in self._procs:
            proc.join(max(0.0, min(0.5, deadline - time.monotonic())))
        with self._lock:
            for conn in self._conns:
                conn.close()
        return clean

    def kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                logger.warning("killing router process %s", proc.pid)
                try:
                    proc.kill()
                except OSError:
                    pass
        shutil.rmtree(self.metrics_dir, ignore_errors=True)
