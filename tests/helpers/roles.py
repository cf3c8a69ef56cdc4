"""A prefill role and a decode role wired together by the local transfer backend, driven without sockets or Ray.

The tests in tests/prefill and tests/decode play the router by hand: they build typed commands (``Reserve``,
``Prefill``, ``Start``, ``Abort``), hand them to a role's ``handle``, turn the roles' loops by calling ``tick``, and
read the typed events each role emitted. Nothing here decides what a role does: ``RolePair`` only holds the two
roles, their engines and event logs, and a few steps every hand-off test takes (reserve, prefill, start; or, for
conditional disaggregation, a reservation whose short rest the decode role computes itself).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from decode.worker import DecodeRole, kv_sink
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import RequestOutput, SamplingParams, TokenLogprob
from prefill.worker import PrefillRole
from transfer.config import TransferConfig
from transfer.local_backend import LocalHub, LocalReceiver, LocalSender
from transfer.wire import ModelFingerprint
from worker.messages import ErrorEvent, Event, Prefill, Reserve, Reserved, Start, Timing, TokenItem, Tokens


class EventLog:
    """A role's ``emit``: every event it sent, in order."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def __call__(self, event: Event) -> None:
        self.events.append(event)

    def of(self, cls: type, rid: str | None = None) -> list:
        return [e for e in self.events if isinstance(e, cls) and (rid is None or getattr(e, "rid", None) == rid)]

    def errors(self) -> list[tuple[str, str]]:
        return [(e.rid, e.code.value) for e in self.of(ErrorEvent)]

    def items(self, rid: str) -> list[TokenItem]:
        """A role's ``tokens`` items for one request, in order (a prefill role's: its first token)."""
        return [item for event in self.of(Tokens) for item in event.items if item.rid == rid]


def build_engine(model, **overrides) -> LLMEngine:
    settings = dict(model=str(model), kv_blocks=256)
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


def greedy(max_tokens: int = 12, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


def copy_params(params: SamplingParams) -> SamplingParams:
    """What msgspec decodes on each worker: its own copy (the prefill role sets ``max_tokens`` to 1 on its own)."""
    return params.copy()


@dataclass
class RolePair:
    prefill: PrefillRole
    decode: DecodeRole
    prefill_events: EventLog
    decode_events: EventLog
    model: str
    hub: LocalHub | None = field(default=None, repr=False)  # the pair's private transfer hub (more roles may join)
    _reference: LLMEngine | None = field(default=None, repr=False)

    # ---- the loops ---------------------------------------------------------------------------------------------

    def tick(self, times: int = 1) -> None:
        for _ in range(times):
            self.prefill.tick()
            self.decode.tick()

    def run_until(self, condition: Callable[[], bool], timeout_s: float = 30.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{what} not reached in {timeout_s} s; prefill events "
                    f"{self.prefill_events.events[-5:]}, decode events {self.decode_events.events[-5:]}"
                )
            self.tick()

    def settle(self, timeout_s: float = 30.0) -> None:
        """Tick until neither role holds a request nor a transfer."""
        self.run_until(lambda: self.idle, timeout_s, "both roles idle")

    @property
    def idle(self) -> bool:
        return (
            not self.prefill.engine.requests
            and not self.decode.engine.requests
            and not self.prefill.sender.active_transfers()
            and not self.decode.receiver.pending_transfers()
        )

    # ---- the router's steps, by hand ---------------------------------------------------------------------------

    def reserve(self, rid: str, prompt: list[int], params: SamplingParams, local_max: int = 0) -> Reserved:
        """``local_max``: the router's ``local_prefill_max_tokens`` (the worker prefills a short rest at once)."""
        command = Reserve(rid=rid, prompt=list(prompt), params=copy_params(params), local_prefill_max_tokens=local_max)
        self.decode.handle(command, time.monotonic())
        return self.decode_events.of(Reserved, rid)[-1]

    def send_prefill(
        self, rid: str, prompt: list[int], params: SamplingParams, reserved: Reserved, arrival_s: float | None = None
    ) -> None:
        command = Prefill(
            rid=rid,
            prompt=list(prompt),
            params=copy_params(params),
            kv_address=reserved.kv_address,
            dst_blocks=list(reserved.blocks),
            cached_tokens=reserved.cached_tokens,
        )
        self.prefill.handle(command, time.monotonic() if arrival_s is None else arrival_s)

    def wait_first_token(self, rid: str, decode_too: bool = True) -> TokenItem:
        """Tick the prefill role (and the decode role, unless ``decode_too`` is False) until ``rid``'s first token."""

        def step() -> None:
            self.prefill.tick()
            if decode_too:
                self.decode.tick()

        deadline = time.monotonic() + 30
        while not self.prefill_events.items(rid):
            assert time.monotonic() < deadline and not self.prefill_events.of(ErrorEvent, rid), (
                self.prefill_events.events
            )
            step()
        return self.prefill_events.items(rid)[0]

    def start(self, rid: str, first: TokenItem) -> None:
        self.decode.handle(Start(rid=rid, tokens=first.token_ids[:1]), time.monotonic())

    def handoff(self, rid: str, prompt: list[int], params: SamplingParams) -> tuple[TokenItem, list]:
        """The whole happy path for one request: reserve, prefill, start, decode to the finish."""
        reserved = self.reserve(rid, prompt, params)
        assert reserved.ok, reserved
        self.send_prefill(rid, prompt, params, reserved)
        first = self.wait_first_token(rid)
        self.start(rid, first)
        self.run_until(lambda: self.finished(rid), what=f"{rid} finished")
        return first, self.decode_events.items(rid)

    def local(self, rid: str, prompt: list[int], params: SamplingParams) -> Reserved:
        """The whole local path for one request: a reservation the decode role prefills itself, to the finish."""
        reserved = self.reserve(rid, prompt, params, local_max=len(prompt))
        assert reserved.ok and reserved.prefill_local, reserved
        self.run_until(lambda: self.finished(rid), what=f"{rid} finished")
        return reserved

    def finished(self, rid: str) -> bool:
        return any(item.finish_reason is not None for item in self.decode_events.items(rid))

    # ---- what the client gets, and what it should get ----------------------------------------------------------

    def client_view(self, rid: str) -> tuple[list[int], str, str]:
        """The prefill role's first token and text (none: prefilled on the decode role), then the decode role's
        tokens and texts: (ids, text, reason)."""
        firsts = self.prefill_events.items(rid)
        assert len(firsts) <= 1 and all(first.finish_reason is None for first in firsts)
        items = self.decode_events.items(rid)
        assert items and items[-1].finish_reason is not None and all(i.finish_reason is None for i in items[:-1])
        ids = [t for first in firsts for t in first.token_ids] + [t for item in items for t in item.token_ids]
        text = "".join(first.text for first in firsts) + "".join(item.text for item in items)
        return ids, text, items[-1].finish_reason.value

    def expected(self, prompt: list[int], params: SamplingParams) -> tuple[list[int], str, str]:
        """One engine's ``generate``: what the hand-off must give, token for token and character for character."""
        if self._reference is None:
            self._reference = build_engine(self.model)
        [result] = self._reference.generate([prompt], copy_params(params))
        return result.token_ids, result.text, result.finish_reason

    def expected_outputs(self, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
        """One engine's outputs for the request, step by step (its logprobs, the prompt's, its prefix-cache hit): what
        the hand-off's events must carry. Run on the reference engine, whose prefix cache this request may warm."""
        if self._reference is None:
            self._reference = build_engine(self.model)
        engine, rid = self._reference, f"reference-{uuid.uuid4().hex[:8]}"
        engine.add_request(list(prompt), copy_params(params), rid)
        outputs: list[RequestOutput] = []
        while not (outputs and outputs[-1].finished):
            outputs += [output for output in engine.step() if output.request_id == rid]
        return outputs

    def client_logprobs(self, rid: str) -> list[TokenLogprob]:
        """Every output token's logprobs as the router would stream them: the prefill role's first token's, then the
        decode role's, item by item (each item's must be one per token id; none when it has no token)."""
        firsts = self.prefill_events.items(rid)
        out = [lp for first in firsts for lp in first.logprobs or []]
        for item in self.decode_events.items(rid):
            if not item.token_ids:
                assert item.logprobs is None, item
                continue
            assert item.logprobs is not None and len(item.logprobs) == len(item.token_ids), item
            out += item.logprobs
        return out

    def decode_timings(self, rid: str) -> list[Timing | None]:
        return [item.timing for item in self.decode_events.items(rid)]

    # ---- the end of every test ---------------------------------------------------------------------------------

    def check_no_leaks(self) -> None:
        """No block, request or transfer left on either side (the check every role test ends with)."""
        for engine in (self.prefill.engine, self.decode.engine, self._reference):
            if engine is not None:
                assert not engine.has_unfinished()
                engine.check_no_leaks()
        assert self.prefill.sender.active_transfers() == []
        assert self.decode.receiver.pending_transfers() == []
        assert self.prefill.load().leased_transfers == 0 and self.decode.load().awaiting_kv == 0

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()


def make_role_pair(
    model,
    *,
    stream_kv: bool = True,
    failure_policy: str = "fail",
    headroom_tokens: int = 0,
    start_deadline_s: float = 30.0,
    transfer: TransferConfig | None = None,
    prefill_engine: dict | None = None,
    decode_engine: dict | None = None,
) -> RolePair:
    """A prefill role and a decode role on their own engines, joined by a private local transfer hub."""
    prefill_llm = build_engine(model, **(prefill_engine or {}))
    decode_llm = build_engine(model, **(decode_engine or {}))
    config = transfer or TransferConfig()
    hub = LocalHub()  # private: no other test's receiver can be reached
    fingerprint = ModelFingerprint.from_spec(prefill_llm.kv_spec)
    sender = LocalSender(fingerprint, config, hub=hub)
    receiver = LocalReceiver(
        ModelFingerprint.from_spec(decode_llm.kv_spec),
        kv_sink(decode_llm),
        f"local://decode-{uuid.uuid4().hex[:8]}",
        config,
        hub=hub,
    )
    prefill_events, decode_events = EventLog(), EventLog()
    prefill = PrefillRole("prefill-0", prefill_llm, sender, prefill_events, stream_kv=stream_kv)
    decode = DecodeRole(
        "decode-0",
        decode_llm,
        receiver,
        decode_events,
        failure_policy=failure_policy,
        headroom_tokens=headroom_tokens,
        start_deadline_s=start_deadline_s,
        make_migration_sender=lambda: LocalSender(ModelFingerprint.from_spec(decode_llm.kv_spec), config, hub=hub),
    )
    return RolePair(prefill, decode, prefill_events, decode_events, str(model), hub)


class RolePairs:
    """Makes the ``RolePair`` objects of one test and closes them after it (the ``role_pair`` fixture of tests/prefill and
    tests/decode): ``with RolePairs(model) as pairs: pair = pairs.make(stream_kv=False)``."""

    def __init__(self, model) -> None:
        self.model = model
        self.pairs: list[RolePair] = []

    def make(self, model=None, **options) -> RolePair:
        pair = make_role_pair(model or self.model, **options)
        self.pairs.append(pair)
        return pair

    def __enter__(self) -> RolePairs:
        return self

    def __exit__(self, *exc) -> None:
        for pair in self.pairs:
            pair.close()


def assert_same_logprobs(ours: list, theirs: list, tolerance: float = 1e-4) -> None:
    """Two lists of ``TokenLogprob`` (None entries allowed, as a prompt's first) hold the same figures: the chosen
    token and its logprob, the top values, and the top ids (where two values are tied their order may differ)."""
    assert len(ours) == len(theirs), (len(ours), len(theirs))
    for index, (a, b) in enumerate(zip(ours, theirs)):
        if a is None or b is None:
            assert a is None and b is None, index
            continue
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) <= tolerance, (index, a, b)
        assert len(a.top) == len(b.top), (index, a, b)
        values = [value for _, value in a.top]
        for j, ((id_a, value_a), (id_b, value_b)) in enumerate(zip(a.top, b.top)):
            assert abs(value_a - value_b) <= tolerance, (index, a, b)
            tied = any(k != j and abs(v - value_a) <= tolerance for k, v in enumerate(values))
            assert id_a == id_b or tied, (index, a, b)
