"""What the autoscaler tests drive it with: a clock the test moves, and a scaler that records each resize and
changes the replica counts the autoscaler reads back (``pools.active``), as ``cluster.run.scaling.Scaler`` does."""

from __future__ import annotations


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class CountingPools:
    def __init__(self, replicas: dict[str, int]) -> None:
        self.replicas = replicas

    def active(self, pool: str) -> list[str]:
        return [f"{pool}-{i}" for i in range(self.replicas.get(pool, 0))]


class RecordingScaler:
    def __init__(self, **replicas: int) -> None:
        self.pools = CountingPools(replicas)
        self.calls: list[tuple[str, int]] = []

    def scale(self, pool: str, replicas: int) -> dict:
        self.calls.append((pool, replicas))
        self.pools.replicas[pool] = replicas
        return {}
