"""The colocated worker: one engine doing both phases, chunked prefill mixed into decode steps (the baseline
disaggregation must beat, behind the same router, API and protocol)."""

from __future__ import annotations

from worker.messages import Command, Generate
from worker.role import Role
from worker.spec import WorkerRole


class ColocatedRole(Role):
    kind = WorkerRole.COLOCATED

    def handle(self, command: Command, arrival_s: float) -> None:
        if not isinstance(command, Generate):
            return super().handle(command, arrival_s)
        self.engine.add_request(command.prompt, command.params, command.rid, arrival_s=arrival_s)

    def tick(self) -> None:
        if self.engine.has_unfinished():
            self.emit_outputs(self.engine.step())
