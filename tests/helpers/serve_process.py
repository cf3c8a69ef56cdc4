"""`pdserve serve` as a real process for tests that use it as a user does: started with a config file, its URL read
from what it prints, and killed (by its own pid) if the test did not stop it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

URL_PATTERN = re.compile(r"at (http://127\.0\.0\.1:\d+)/v1")


@contextmanager
def serve_process(
    config: Path, start_timeout_s: float = 120.0, env: dict[str, str] | None = None
) -> Iterator[tuple[subprocess.Popen, str]]:
    """Yield (the process, its base URL) once it prints where it serves; a process that exits or stays silent
    fails the test with everything it printed. It leads a session of its own, so Ray's processes are in it too."""
    import ray

    if ray.is_initialized():  # the serve process starts its own local Ray; this one must not hold one
        ray.shutdown()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "serve", "--config", str(config), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        url, deadline, seen = None, time.monotonic() + start_timeout_s, []
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
            seen.append(line)
            match = URL_PATTERN.search(line)
            url = match.group(1) if match else None
        assert url, "".join(seen)
        yield proc, url
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
