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
        self.refuse_switch = ""  # set: switch_pool refuses with this reason

    def scale(self, pool: str, replicas: int) -> dict:
        self.calls.append((pool, replicas))
        self.pools.replicas[pool] = replicas
        return {}

    def switch_pool(self, source: str, to: str) -> dict:
        """One worker of ``source`` into ``to``; ScaleError as the real one's when ``refuse`` says why not."""
        from cluster.routing.errors import ScaleError

        if self.refuse_switch:
            raise ScaleError("worker", self.refuse_switch)
        worker = self.pools.active(source)[-1]
        self.calls.append(("switch", f"{worker}->{to}"))  # type: ignore[arg-type]
        self.pools.replicas[source] -= 1
        self.pools.replicas[to] += 1
        return {"worker": worker, "to": to}
