"""The colocated worker: one engine doing both phases, chunked prefill mixed into decode steps.

It is the baseline disaggregation must beat, served through the same router, API and protocol: the router sends
``generate``; every step's new tokens and their text (detokenized here, by the engine) for all requests go back in
one ``tokens`` message.
"""

from __future__ import annotations

from worker.protocol import params_from_wire
from worker.runtime import WorkerRuntime, finish_timing


class ColocatedWorker(WorkerRuntime):
    role = "colocated"

    def handle(self, message: dict) -> None:
        if message["type"] != "generate":
            return super().handle(message)
        self.engine.add_request(
            list(message["prompt"]), params_from_wire(message["params"]), message["rid"], arrival_s=message["arrival_s"]
        )

    def tick(self) -> None:
        if not self.engine.has_unfinished():
            return
        items = []
        for output in self.engine.step():
            if output.error is not None:  # finish_reason ERROR (blocks already freed): an error for that request only
                self.counters["errors"] += 1
                self.emit_error(output.request_id, output.error, output.error_code or "worker_error")
                continue
            timing = None
            if output.num_output_tokens == 1 or output.finished:
                request = self.engine.requests.get(output.request_id)
                if request is not None:
                    timing = {f"prefill_{key}": value for key, value in finish_timing(request).items()}
            items.append([output.request_id, output.new_token_ids, output.text_delta,
                          output.finish_reason and output.finish_reason.value, timing])
        if items:
            self.emit({"type": "tokens", "worker": self.name, "items": items})
