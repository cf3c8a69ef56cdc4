"""Who may reach the server: at start-up, on the final config, refuse an unauthenticated bind other machines reach."""

from __future__ import annotations

import ipaddress

from cluster.config import ClusterConfig, ConfigError


def is_loopback(host: str) -> bool:
    """Only literal loopback addresses and ``localhost`` count; any other name may resolve to a public address."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name, "auto", "" or "*": reachable from elsewhere for all we know


def check_network_exposure(config: ClusterConfig, http_host: str | None = None) -> None:
    """Refuse a non-loopback HTTP server (``http_host`` overrides ``router.host``) or workers without
    ``router.api_key``, unless ``router.allow_unauthenticated``."""
    if config.router.api_key or config.router.allow_unauthenticated:
        return
    for field, host in (("router.host", http_host or config.router.host), ("ray.worker_host", config.ray.worker_host)):
        if not is_loopback(host):
            raise ConfigError(
                f"{field}: {host!r} is reachable from other machines, and router.api_key is not set: anyone who can "
                "reach it could use the cluster. Set router.api_key, bind a loopback address, or set "
                "router.allow_unauthenticated: true to serve without a key deliberately"
            )
