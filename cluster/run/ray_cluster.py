"""Starting or joining Ray, so that nobody else can use it: a local Ray on loopback, a real cluster only with tokens.

Ray binds its gRPC servers to all interfaces unless the node's address is loopback; ``init_local_ray`` applies Ray's
laptop rule (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, keeping a node on 127.0.0.1) and checks it. A cluster is
joined only if it refuses callers without its token (an unauthenticated Ray runs any code anyone who reaches it
submits): ``check_ray_auth`` asks the GCS once from a child process that has no token.
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import stat
import subprocess
import sys
from pathlib import Path

from cluster.config import ClusterConfig, ConfigError, pool_layout
from cluster.network_exposure import is_loopback
from transfer.private_dir import runtime_dir

LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
AUTH_PROBE_TIMEOUT_S = 30.0

# Run in a child with RAY_AUTH_MODE=disabled and no token: it prints "open" if the GCS answers anyway.
_AUTH_PROBE = """
import sys
from ray._raylet import GcsClient
from ray.exceptions import AuthenticationError
try:
    GcsClient(address=sys.argv[1]).internal_kv_get(b"pdserve", namespace=None, timeout=10)
except AuthenticationError:
    print("token")
else:
    print("open")
"""


def keep_ray_on_loopback() -> None:
    """Make every Ray node started from this process (and its children) take 127.0.0.1; call it before the first
    local Ray starts (``ray`` may already be imported)."""
    os.environ.update(LOOPBACK_ENV)
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:  # the module read the variable when it was imported
        constants.ENABLE_RAY_CLUSTER = False  # type: ignore[attr-defined]  # Ray's module, typed as a bare ModuleType


def local_ray_token() -> Path | None:
    """A token of the local Ray's own, in a file only this user can read (0600 in a 0700 folder): Ray would otherwise
    write ``~/.ray/auth_token`` with the default umask (0644), and any local user holding it can join as a driver and
    read the cluster secret from the workers. The Ray processes started from here find it by RAY_AUTH_TOKEN_PATH.
    None where the user turned Ray's authentication off (RAY_AUTH_MODE=disabled), deliberately."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        return None
    folder = runtime_dir()
    path = folder / f"ray-{os.getpid()}-{secrets.token_hex(4)}.token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    os.environ.pop("RAY_AUTH_TOKEN", None)  # it would win over the file
    os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(path)})
    return path


def check_token_file(config: ClusterConfig) -> None:
    """Joining a cluster: refuse a token file that others can read (they could join it too), naming it."""
    if os.environ.get("RAY_AUTH_TOKEN") or config.ray.allow_unauthenticated:
        return
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    try:
        mode = path.stat().st_mode
    except OSError:
        return  # no file: Ray says so itself, or the cluster is open and check_ray_auth refuses it
    if mode & 0o077:
        raise ConfigError(
            f"ray.address: Ray's token file {path} can be read by other users (mode {stat.S_IMODE(mode):o}): with "
            f"it they can join the cluster and run code on it. Run `chmod 600 {path}`"
        )


def init_local_ray(num_cpus: int, namespace: str) -> None:
    """A fresh local Ray on loopback (``address="local"``: never another Ray running on this machine), with a token
    of its own (``local_ray_token``)."""
    import ray

    keep_ray_on_loopback()
    token = local_ray_token()
    if token is not None:  # this process's Ray read its settings when it was imported: read them again
        from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    # log_to_driver=False: workers log to Ray's session files, and commands that print JSON keep stdout clean
    ray.init(
        address="local",
        num_cpus=num_cpus,
        namespace=namespace,
        include_dashboard=False,
        logging_level=logging.WARNING,
        log_to_driver=False,
    )
    if token is not None:
        atexit.register(token.unlink, missing_ok=True)
    node_ip = ray.util.get_node_ip_address()
    if not is_loopback(node_ip):
        ray.shutdown()
        raise RuntimeError(f"the local Ray took {node_ip} as its address, not loopback: it would listen beyond it")


def check_ray_auth(config: ClusterConfig, gcs_address: str, timeout_s: float = AUTH_PROBE_TIMEOUT_S) -> None:
    """Refuse a Ray cluster that answers callers without its token, unless ``ray.allow_unauthenticated``."""
    if config.ray.allow_unauthenticated:
        return
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env["RAY_AUTH_MODE"] = "disabled"
    try:
        probe = subprocess.run(
            [sys.executable, "-c", _AUTH_PROBE, gcs_address],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        answer = probe.stdout.strip().splitlines()[-1:] or [probe.stderr.strip()[-300:]]
    except subprocess.TimeoutExpired:
        answer = [f"no answer within {timeout_s:.0f} s"]
    if answer == ["token"]:
        return
    found = (
        "answers callers that have no token (its RAY_AUTH_MODE is not token)"
        if answer == ["open"]
        else f"could not be checked for token authentication ({answer[0]})"
    )
    raise ConfigError(
        f"ray.address: the Ray cluster at {gcs_address} {found}: anyone who can reach it can run code on it. "
        "Start every node with RAY_AUTH_MODE=token and one shared token (docs/gpu.md, configs/cluster.yaml), or set "
        "ray.allow_unauthenticated: true to use this cluster deliberately"
    )


def connect_ray(config: ClusterConfig, address: str | None) -> bool:
    """Join the configured cluster, or start a local one; True if Ray was started (and must be shut down) here."""
    import ray

    if ray.is_initialized():
        return False
    address = address or config.ray.address
    if not address:
        needed = sum(pool.replicas * pool.cpus_per_replica for _, _, pool in pool_layout(config))
        init_local_ray(max(int(needed + 0.999), os.cpu_count() or 1), config.ray.namespace)
        return True
    ray.init(address=address, namespace=config.ray.namespace, logging_level=logging.WARNING)
    try:
        check_ray_auth(config, ray.get_runtime_context().gcs_address)
        check_token_file(config)  # a cluster that takes tokens: ours must be this user's alone
    except BaseException:
        ray.shutdown()
        raise
    return True
