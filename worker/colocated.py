"""The colocated worker: one engine doing both phases, chunked prefill mixed into decode steps.

It is the baseline disaggregation must beat, served through the same router, API and protocol: the router sends
``generate``; every step's new tokens and their text (detokenized here, by the engine) for all requests go back in
one ``tokens`` message, with their logprobs when a request asked for them; a request's first token also carries the
prompt's logprobs and how many prompt tokens the prefix cache held.
"""

from __future__ import annotations

from worker.messages import Command, ErrorCode, Generate, Tokens
from worker.role import Role, computed_here_item
from worker.runtime import WorkerRuntime
from worker.spec import WorkerRole, WorkerSpec


class ColocatedRole(Role):
    kind = WorkerRole.COLOCATED

    def handle(self, command: Command, arrival_s: float) -> None:
        if not isinstance(command, Generate):
            return super().handle(command, arrival_s)
        self.engine.add_request(command.prompt, command.params, command.rid, arrival_s=arrival_s)

    def tick(self) -> None:
        if not self.engine.has_unfinished():
            return
        items = []
        for output in self.engine.step():
            if output.error is not None:  # finish_reason ERROR (blocks already freed): an error for that request only
                self.counters.errors += 1
                self.emit_error(output.request_id, output.error, ErrorCode.from_engine(output.error_code))
                continue
            items.append(computed_here_item(output))
        if items:
            self.emit(Tokens(worker=self.name, items=items))


class ColocatedWorker(WorkerRuntime):
    """The colocated role in a worker process (sockets, loop, heartbeat)."""

    role: ColocatedRole

    def __init__(self, spec: WorkerSpec) -> None:
        super().__init__(spec, ColocatedRole)
