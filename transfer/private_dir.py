"""The user's private folder on this node: the admin token and the local Ray's token (cluster/), and the Unix sockets
that hand a decode worker's KV cache to same-node senders (transfer/fd_pass.py). Nobody but the user (and root) can
enter it, so another user cannot even connect to what listens there."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def runtime_dir() -> Path:
    """``$XDG_RUNTIME_DIR/pdserve`` (a per-user tmpfs) or ``<tmp>/pdserve-<uid>``; made 0700, and refused if another
    user owns it or others may enter it."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    folder = Path(base) / "pdserve" if base else Path(tempfile.gettempdir()) / f"pdserve-{os.getuid()}"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = folder.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(f"{folder} must be a folder of this user that no one else can enter (mode 0700)")
    return folder
