"""A child process that outlives the process that started it: the background compile (engine/background_compile.py),
which is paid once per machine and must finish even when its serving process stops first.

A plain child does not: Ray kills a worker's children when the worker exits (``kill_child_processes_on_worker_exit``),
and a terminal's Ctrl-C reaches its whole process group. So the child is started by a shell that backgrounds it in a
session of its own and exits at once: the child's parent is then init, not the worker. Its exit status comes back on
a pipe (it writes it there last, ``report_exit``); the pipe's end without a status means it died.
"""

from __future__ import annotations

import io
import os
import subprocess
import time
from collections.abc import Mapping, Sequence

STATUS_FD_ENV = "PDSERVE_EXIT_STATUS_FD"  # the pipe's write end, as the child sees it
LAUNCH_TIMEOUT_S = 10.0  # the shell's start and exit
DIED = -1  # the status of a child that ended without reporting one (killed)


class Detached:
    """The handle of a detached child: ``poll`` and ``wait`` as ``subprocess.Popen``'s, not a parent's."""

    def __init__(self, pid: int, status_fd: int) -> None:
        self.pid = pid
        os.set_blocking(status_fd, False)
        self._pipe: io.FileIO | None = io.FileIO(status_fd, "r")  # closed when read to its end, or with the handle
        self._read = b""
        self._status: int | None = None

    def poll(self) -> int | None:
        """The child's exit status once it has ended (``DIED`` when it reported none), else None."""
        while self._pipe is not None:
            chunk = self._pipe.read(64)
            if chunk is None:  # nothing yet
                return None
            self._read += chunk
            if chunk and not self._read.endswith(b"\n"):
                continue
            # reported (a copy of the pipe its own children may hold does not matter), or the pipe ended without it
            self._pipe.close()
            self._pipe = None
            try:
                self._status = int(self._read) if self._read.endswith(b"\n") else DIED
            except ValueError:
                self._status = DIED
        return self._status

    def wait(self, timeout: float) -> int | None:
        """The exit status, or None if the child still runs after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while (status := self.poll()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return status


def start_detached(argv: Sequence[str], env: Mapping[str, str]) -> Detached:
    """Start ``argv`` detached (stdin and stdout on /dev/null, stderr this process's)."""
    read_fd, write_fd = os.pipe()
    try:
        launcher = subprocess.Popen(
            ["/bin/sh", "-c", '"$@" </dev/null >/dev/null & echo $!', "sh", *argv],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            pass_fds=(write_fd,),
            start_new_session=True,
            env={**env, STATUS_FD_ENV: str(write_fd)},
        )
        out, _ = launcher.communicate(timeout=LAUNCH_TIMEOUT_S)
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    return Detached(int(out.strip()), read_fd)


def report_exit(status: int) -> None:
    """In the child, last: its exit status for the handle (nothing when started otherwise)."""
    fd = os.environ.get(STATUS_FD_ENV)
    if fd is None:
        return
    try:
        os.write(int(fd), f"{status}\n".encode())
    except (OSError, ValueError):
        pass  # nobody listens any more
