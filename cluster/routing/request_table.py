"""The router's table of requests in flight, and what each one leaves behind when it ends.

Split from the router (cluster/routing/router.py), which receives the workers' events and runs each request's ``generate``
loop: this is the per-request bookkeeping both of those share, and it knows nothing of sockets, events or placement.
Requests are keyed by their id on the wire (a retry gets a new one, ``redispatch``). A request is opened (its stream,
counted in flight), pushed to as its tokens arrive, and at its end recorded (a finish's metrics, and the response's
``timing`` map kept in ``last_timing`` for the API to collect) and released: its workers stop counting it in their
load, and the decode reservation queue is woken. ``abort`` tells every worker that holds state for it to free it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from cluster.routing.membership import Membership, WorkerHandle
from cluster.routing.metrics import RouterMetrics
from cluster.routing.streams import Stream
from engine.request import TokenLogprob
from worker.messages import Abort, Command, DecodeTiming, PrefillTiming

MAX_RECORDS = 10_000  # finished requests' timing and recent requests' placements kept (oldest dropped first)


class RequestTable:
    def __init__(
        self,
        metrics: RouterMetrics,
        members: Membership,
        send: Callable[[WorkerHandle, Command], None],
        wake: Callable[[], None],
    ) -> None:
        """``send``: the router's command path to a worker; ``wake``: the decode reservation queue's."""
        self.metrics = metrics
        self.members = members
        self._send = send
        self._wake = wake
        self.streams: dict[str, Stream] = {}
        self.last_timing: OrderedDict[str, dict] = OrderedDict()  # finished requests' timing, for the response

    def open(self, rid: str, num_prompt_tokens: int) -> Stream:
        stream = Stream(rid, num_prompt_tokens, wire_rid=rid)
        self.streams[rid] = stream
        self.metrics.inflight.inc()
        return stream

    def push(
        self,
        stream: Stream,
        num_tokens: int,
        text: str,
        finish_reason: str | None,
        logprobs: list[TokenLogprob] | None = None,
        prompt_logprobs: list[TokenLogprob | None] | None = None,
        cached_tokens: int | None = None,
    ) -> None:
        first = stream.first_token_s is None
        pushed = stream.push(num_tokens, text, finish_reason, logprobs, prompt_logprobs, cached_tokens)
        if pushed and first and stream.first_token_s is not None:
            self.metrics.ttft.observe(stream.first_token_s - stream.started_s)

    def record_finish(self, stream: Stream) -> None:
        now = time.monotonic()
        self.metrics.requests.labels("finished").inc()
        self.metrics.e2e.observe(now - stream.started_s)
        self.metrics.prompt_tokens.inc(stream.num_prompt_tokens)
        self.metrics.generated_tokens.inc(stream.num_output_tokens)
        if stream.first_token_s is not None and stream.num_output_tokens > 1:
            self.metrics.tpot.observe((now - stream.first_token_s) / (stream.num_output_tokens - 1))
        stream.timing["ttft_s"] = (stream.first_token_s or now) - stream.started_s
        stream.timing["e2e_s"] = now - stream.started_s
        known = sum(stream.timing.get(k, 0.0) for k in ("router_queue_s", "prefill_queue_s", "prefill_compute_s"))
        stream.timing["first_token_delivery_s"] = max(0.0, stream.timing["ttft_s"] - known)
        # same-host monotonic stamps: how long after the prefill ended the decode side had the whole KV
        prefill_end, kv_done = stream.timing.pop("prefill_end_mono", None), stream.timing.pop("kv_done_mono", None)
        if prefill_end is not None and kv_done is not None:
            stream.timing["kv_after_prefill_s"] = kv_done - prefill_end
            self.metrics.kv_after_prefill.observe(kv_done - prefill_end)
        if "kv_transfer_s" in stream.timing:
            self.metrics.kv_transfer.observe(stream.timing["kv_transfer_s"])
        self.last_timing[stream.rid] = stream.timing
        while len(self.last_timing) > MAX_RECORDS:  # a client that never collects its timing cannot grow this
            self.last_timing.popitem(last=False)

    def _unassign(self, stream: Stream) -> None:
        # a prefill worker stops counting a request at its first token (the router's ``_on_first_token``), a decode
        # worker at its end
        holders = [stream.decode] + ([stream.prefill] if stream.first_token_s is None else [])
        for name in set(holders) - {None}:
            worker = self.members.get(name)
            if worker is not None:
                worker.inflight = max(0, worker.inflight - 1)
        stream.prefill = stream.decode = None

    def redispatch(self, stream: Stream, wire_rid: str) -> None:
        """Free the old dispatch everywhere and give the request a new id on the wire."""
        self.abort(stream.wire_rid)
        self._unassign(stream)
        self.streams.pop(stream.wire_rid, None)
        stream.wire_rid = wire_rid
        self.streams[wire_rid] = stream
        stream.reset()

    def release(self, stream: Stream) -> None:
        self.streams.pop(stream.wire_rid, None)
        self.metrics.inflight.dec()
        self._unassign(stream)
        self._wake()

    def abort(self, wire_rid: str) -> None:
        """Tell every worker that holds state for the request to free it, those marked dead too: one that was only
        cut off (and is revived when heard from again) must not keep the request."""
        stream = self.streams.get(wire_rid)
        if stream is None:
            return
        for name in {stream.prefill, stream.decode} - {None}:
            worker = self.members.get(name)
            if worker is not None:
                self._send(worker, Abort(wire_rid))


def response_timing(timing: PrefillTiming | DecodeTiming) -> dict[str, float]:
    """A worker's timing as the response's ``timing`` map names it (the one place that converts): a prefill's fields
    as ``prefill_<field>``, the decode worker's under their own names, ``recomputed`` as 1.0; fields the worker did
    not reach (None, or recomputed False) are left out."""
    prefix = "prefill_" if isinstance(timing, PrefillTiming) else ""
    out = {}
    for name in timing.__struct_fields__:
        value = getattr(timing, name)
        if value is not None and value is not False:
            out[prefix + name] = 1.0 if value is True else value
    return out
