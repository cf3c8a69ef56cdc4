"""A ``pdserve serve`` started as a subprocess, for a benchmark that measures a served cluster from outside it.

``ServeProcess.start`` runs ``pdserve serve --config F --port 0`` in its own session, drains its output on a thread
for the whole run and waits, bounded, for the lines giving the URL and the workers' PIDs. ``ServeProcess.stop``
sends SIGTERM, waits ``STOP_TIMEOUT_S``, then kills the process group the server leads; then any reported worker
still running, and whatever of Ray's is left in the group. The cluster's shutdown tests use ``process_running`` too.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STOP_TIMEOUT_S = 15.0


@dataclass
class ServeProcess:
    """A ``pdserve serve`` this bench started: its URL, its workers' PIDs, and the last lines it printed."""

    proc: subprocess.Popen
    url: str | None = None
    worker_pids: list[int] = field(default_factory=list)
    lines: collections.deque = field(default_factory=lambda: collections.deque(maxlen=200))
    ready: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def start(cls, config_path: Path, router_processes: int, timeout_s: float) -> ServeProcess:
        cmd = [sys.executable, "-m", "cli.main", "serve", "--config", str(config_path), "--port", "0"]
        cmd += ["--router-processes", str(router_processes)]
        env = {k: v for k, v in os.environ.items() if k != "PDSERVE_API_KEY"}  # a loopback server of our own
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )  # its own group: a last-resort kill reaches Ray's processes
        serve = cls(proc)
        threading.Thread(target=serve._read, name="frontend-bench-serve-output", daemon=True).start()
        if not serve.ready.wait(timeout_s) or serve.url is None:
            code = proc.poll()
            serve.stop()
            tail = "".join(serve.lines)[-3000:]
            why = f"exited with status {code}" if code is not None else f"did not start within {timeout_s:.0f} s"
            raise RuntimeError(f"pdserve serve {why}; its output:\n{tail}")
        return serve

    def _read(self) -> None:
        """Drain the output (a full pipe would block the server) and parse the start-up lines."""
        for line in self.proc.stdout:
            self.lines.append(line)
            if self.url is None and (match := re.search(r" at (http://\S+?)/v1\b", line)):
                self.url = match.group(1)
            if "workers:" in line:
                self.worker_pids = [int(p) for p in re.findall(r"pid (\d+)", line)]
            if "to stop" in line:
                self.ready.set()
        self.ready.set()  # exited before it was ready

    def stop(self) -> dict:
        """SIGTERM, wait; after ``STOP_TIMEOUT_S`` kill this bench's process group and the workers by PID."""
        started = time.monotonic()
        forced = False
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                forced = True
                _kill_group(self.proc.pid)
                self.proc.wait(timeout=10)
        stop_s = time.monotonic() - started
        time.sleep(0.5)
        left = [pid for pid in self.worker_pids if process_running(pid)]
        for pid in left:  # the serve process should have stopped them
            os.kill(pid, signal.SIGKILL)
        _kill_group(self.proc.pid)  # Ray's processes, if any outlived the serve process in the group it led
        return {
            "pid": self.proc.pid,
            "worker_pids": list(self.worker_pids),
            "exit_code": self.proc.returncode,
            "stop_s": round(stop_s, 2),
            "forced": forced,
            "workers_left_running": len(left),
        }


def process_running(pid: int) -> bool:
    """A process that exists and is not a zombie (a killed worker whose parent is gone may linger as one)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
