"""gpu-check's clock: every section and every loop in it runs against a deadline, so no wait outlives the run.

``Deadline.check`` raises ``OutOfTime`` (naming what was running) once the deadline has passed; loops call it each
turn. A call that cannot be interrupted (a compile, a hung kernel) is bounded by the run's watchdog instead
(checks/gpu/gpu_check.py), which writes what is finished and ends the process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


class OutOfTime(RuntimeError):
    """A section ran past its wall-clock cap (or the run past its budget)."""


@dataclass(frozen=True, slots=True)
class Deadline:
    end: float  # time.monotonic()
    what: str

    @classmethod
    def after(cls, seconds: float, what: str) -> Deadline:
        return cls(time.monotonic() + seconds, what)

    def left(self) -> float:
        return self.end - time.monotonic()

    def passed(self) -> bool:
        return time.monotonic() > self.end

    def check(self, doing: str) -> None:
        if self.passed():
            raise OutOfTime(f"{self.what}: out of time while {doing}")

    def within(self, seconds: float, what: str) -> Deadline:
        """A deadline ``seconds`` from now, never later than this one."""
        return Deadline(min(self.end, time.monotonic() + seconds), what)


NEVER = Deadline(float("inf"), "no deadline")
