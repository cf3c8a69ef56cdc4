"""The credential of ``/admin/*`` (scale, migrate) when no API key is set: without one, any process that can reach
loopback could resize the pools or move requests. Like Jupyter's server token, it is made at start and kept in a file
only the cluster's user can read, which the CLI reads (``pdserve scale`` and the benchmarks find it by the URL).

The token is derived from the cluster secret (``transfer.secret``, made per start unless configured), so every router
process of one cluster computes the same one without being told. With ``router.api_key`` set, the API key is the
admin credential too and no file is written.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from transfer.auth import derive_key
from transfer.private_dir import runtime_dir

if TYPE_CHECKING:
    from cluster.config import ClusterConfig

TOKEN_LABEL = b"pdserve/v1/admin-token"


def admin_token(secret: str) -> str:
    if not secret:
        raise ValueError("the admin token needs the cluster secret (transfer.secret; the launcher makes one)")
    return derive_key(secret, TOKEN_LABEL).hex()


def admin_credential(config: ClusterConfig) -> str:
    """The API key, else the token derived from the cluster secret, else (no secret: an app built by hand) a random
    one that no client knows, so ``/admin/*`` is closed rather than open."""
    if config.router.api_key:
        return config.router.api_key
    return admin_token(config.transfer.secret) if config.transfer.secret else secrets.token_hex(32)


def token_path(url: str) -> Path:
    """The token file of the cluster serving ``url`` (by host and port: one file per listening address)."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    host = (parts.hostname or "127.0.0.1").replace(":", "_")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return runtime_dir() / f"admin-{host}-{port}.token"


def write_token(url: str, token: str) -> Path:
    """Write the token for ``url``, readable by this user only (created 0600, replaced whole)."""
    path = token_path(url)
    temp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.replace(temp, path)
    return path


def read_token(url: str) -> str | None:
    """The token of the cluster at ``url``, or None when this user has none for it."""
    try:
        return token_path(url).read_text().strip() or None
    except OSError:
        return None


def remove_token(url: str, token: str) -> None:
    """Remove ``url``'s token file if it is still this cluster's (a newer cluster on the same port keeps its own)."""
    with contextlib.suppress(OSError):
        if read_token(url) == token:
            token_path(url).unlink()


def admin_headers(url: str, api_key: str | None) -> dict[str, str]:
    """What a client of ``/admin/*`` sends: the API key when it has one, else the token file's token."""
    credential = api_key or read_token(url)
    return {"Authorization": f"Bearer {credential}"} if credential else {}
