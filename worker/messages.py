"""Every control message between the router and the workers: one msgspec Struct per kind, msgpack on the wire.

A message is a map whose ``type`` names its kind; ``decode_command`` / ``decode_event`` return the typed object or
raise ``MalformedMessage`` (undecodable, unknown kind or field, wrong type, out of bounds, too large), so a receiver
never builds anything but these objects. Commands go router -> worker (the live router stamps ``router`` and
``sent_at`` as it sends), events worker -> router. Every request message names the request by its wire id: a fresh
one per reservation attempt, per retry and per move, so a late answer can only concern an attempt the router gave up
on. One hand-off serves prefill -> decode (``Reserve``, ``Prefill``, ``Start``) and decode -> decode (``Reserve``
with ``context_tokens``, ``Export``, ``Frozen``, ``Start``); the flows: docs/request-lifecycle.md.
"""

from __future__ import annotations

import enum
from typing import Annotated, Literal, NamedTuple

import msgspec

from engine.request import MAX_LOGPROBS, FinishReason, SamplingParams, TokenLogprob
from transfer.errors import ProtocolError

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # the ceiling of any control message; each socket's own bound is below it
# what the sizes of the largest real messages are made of (msgpack): a token or block id (uint32), one position's
# logprobs (the chosen and MAX_LOGPROBS top (id, float64) pairs), a generated token's text, and the fields every
# message has (ids, addresses, timing, counters, stop strings) with room to spare
TOKEN_ID_BYTES = 5
POSITION_LOGPROB_BYTES = (MAX_LOGPROBS + 1) * 16 + 16
TOKEN_TEXT_BYTES = 64
ITEM_BYTES = 1024
FIXED_MESSAGE_BYTES = 64 * 1024


def max_command_bytes(max_model_len: int, max_body_bytes: int) -> int:
    """The largest command a router sends a worker that serves ``max_model_len`` tokens: a prompt of that many token
    ids and as many block ids or tokens again (``Prefill``, ``Start``), and a request's parameters, which come from an
    HTTP body of at most ``max_body_bytes`` (counted twice: msgpack may spend more on a number than JSON does)."""
    return min(MAX_MESSAGE_BYTES, FIXED_MESSAGE_BYTES + 2 * TOKEN_ID_BYTES * max_model_len + 2 * max_body_bytes)


def command_queue_bound(max_num_seqs: int, router_queue_size: int) -> int:
    """A worker's command socket's RCVHWM: what routers can have in flight to it (a few commands for each request it
    runs or a router queues, pings, drains), with room for several routers and a stalled loop."""
    return 8 * (max_num_seqs + router_queue_size) + 1024


def max_event_bytes(max_model_len: int, max_num_seqs: int, kv_tokens: int, tokens_per_step: int) -> int:
    """The largest event a worker sends: a step's ``tokens`` for ``max_num_seqs`` requests of ``tokens_per_step``
    tokens each (text and top logprobs), with the prompt logprobs of every prompt whose first token it carries
    (their KV is held, so at most ``kv_tokens`` positions in all), or a move's ``frozen`` (``max_model_len`` ids)."""
    per_item = ITEM_BYTES + tokens_per_step * (TOKEN_ID_BYTES + TOKEN_TEXT_BYTES + POSITION_LOGPROB_BYTES)
    prompt_positions = min(kv_tokens, max_num_seqs * max_model_len)
    return min(
        MAX_MESSAGE_BYTES,
        FIXED_MESSAGE_BYTES
        + max_num_seqs * per_item
        + prompt_positions * POSITION_LOGPROB_BYTES
        + TOKEN_ID_BYTES * max_model_len,
    )


Role = Literal["prefill", "decode", "colocated"]
RefusalReason = Literal["kv_full", "max_num_seqs"]  # why a decode worker refused a reservation (ok=False)


class MalformedMessage(ProtocolError):
    """Authenticated, but not a valid message: undecodable, an unknown kind, a missing, unknown or wrong-typed field,
    or too large. The receiver counts it as ``Rejection.MALFORMED`` (a bug of the sender, not an attack)."""


class ErrorCode(str, enum.Enum):
    """Why a worker failed a request (``error`` events); the router turns it into the client's error code."""

    INVALID_REQUEST = "invalid_request"  # the command itself is wrong (bad params, prompt, unknown request): 400
    WORKER_ERROR = "worker_error"  # a failed step, a router that went silent, a worker going down
    SAMPLING_ERROR = "sampling_error"  # this request's own logits (non-finite)
    KV_TRANSFER_FAILED = "kv_transfer_failed"  # its KV did not arrive
    RESERVATION_EXPIRED = "reservation_expired"  # its first token never reached the decode worker

    @classmethod
    def from_engine(cls, code: str | None) -> ErrorCode:
        """The engine's ``RequestOutput.error_code`` (a string): a code this protocol does not know is a worker
        error, so an error is never dropped for its code."""
        try:
            return cls(code)
        except ValueError:
            return cls.WORKER_ERROR


# ---- timing and counters ---------------------------------------------------------------------------------------


class Timing(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """Where a request's time went (seconds; None: not reached): what workers report and what the response shows.

    Each side fills its own fields; the router merges them and adds its own. ``*_mono`` are monotonic stamps
    compared on one host (``kv_after_prefill_s``) and left out of the response."""

    router_queue_s: float | None = None  # the router: arrival to the dispatch of its prompt
    prefill_queue_s: float | None = None  # the worker that computed the prompt: added until first scheduled
    prefill_compute_s: float | None = None  # ... first scheduled until the first token was sampled
    prefill_end_mono: float | None = None  # ... when the first token was sampled
    prefill_local: bool = False  # the decode worker computed the prompt itself (conditional disaggregation)
    decode_cached_tokens: int | None = None  # prompt tokens the decode worker held already (its prefix cache)
    kv_done_mono: float | None = None  # the decode worker: when the imported KV was complete
    kv_transfer_s: float | None = None  # ... reservation until the complete KV (spans the prefill)
    kv_wait_after_first_token_s: float | None = None  # ... first token here until the complete KV (0: KV first)
    decode_queue_s: float | None = None  # ... admitted until its first decode step ran
    recomputed: bool = False  # ... its KV transfer failed and it was prefilled here (failure_policy: recompute)
    ttft_s: float | None = None  # the router, at the finish: arrival to first token
    e2e_s: float | None = None  # ... arrival to the last token
    first_token_delivery_s: float | None = None  # ... TTFT less router queue and prefill (the first token's trip)
    kv_after_prefill_s: float | None = None  # ... KV complete minus first token sampled (<= 0: fully hidden)
    migrations: int | None = None  # the router: moves to another decode worker while it ran
    migration_s: float | None = None  # ... the time its stream stood still for them (freeze to the move's end)

    def merge(self, other: Timing) -> None:
        """Take every field ``other`` has set."""
        for name in other.__struct_fields__:
            value = getattr(other, name)
            if value is not None and value is not False:
                setattr(self, name, value)

    def response(self) -> dict[str, float]:
        """The response's ``timing`` map: set fields only, flags as 1.0, no monotonic stamps."""
        out = {}
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if value is not None and value is not False and not name.endswith("_mono"):
                out[name] = float(value)
        return out


class WorkerLoad(msgspec.Struct):
    """A worker's current load: gauges (``pdserve_worker{key=<field>}``)."""

    waiting: int = 0
    running: int = 0
    requests: int = 0
    max_requests: int = 0  # its engine's max_num_seqs: a decode worker holding this many refuses reservations
    free_blocks: int = 0
    total_blocks: int = 0
    awaiting_kv: int = 0  # decode: reservations whose KV or first token has not arrived
    leased_transfers: int = 0  # prefill: requests whose blocks are held until the decode worker has the KV


class WorkerCounters(msgspec.Struct):
    """A worker's monotonic totals since it started (``pdserve_worker_total{key=<field>}``)."""

    errors: int = 0
    aborts: int = 0
    control_rejected: int = 0  # commands dropped unread or undecodable (by Rejection reason in the log)
    handshake_refused: int = 0  # peers without the cluster's keys, dropped at the command socket's handshake
    step_failures: int = 0
    transfers_ok: int = 0
    transfers_failed: int = 0
    transfer_bytes: int = 0
    transfer_seconds: float = 0.0  # prefill: time its sender spent on finished transfers
    reservations_refused: int = 0
    local_prefills: int = 0  # decode: reservations prefilled here (no prefill worker, no transfer)
    recomputes: int = 0
    reservations_expired: int = 0
    kv_rejected: int = 0  # decode: KV-plane messages dropped unread (bad or missing MAC, replayed, too many frames)
    kv_handshake_refused: int = 0  # decode: KV peers without the cluster's password, dropped at connect
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    migrations_out: int = 0  # decode: running requests whose KV went to another decode worker
    migrations_in: int = 0  # decode: running requests taken over from another decode worker
    migration_bytes: int = 0  # decode: KV bytes shipped out by migration
    # KV tiers below the device (engine/kv_tiers.py): prompt tokens loaded back instead of computed, bytes copied
    # down into each tier and back up from it, and the time requests spent LOADING
    host_hit_tokens: int = 0
    disk_hit_tokens: int = 0
    host_saved_bytes: int = 0
    disk_saved_bytes: int = 0
    host_loaded_bytes: int = 0
    disk_loaded_bytes: int = 0
    tier_loads: int = 0
    tier_load_seconds: float = 0.0
    # speculative decoding (engine/speculative.py): tokens proposed, those the model kept, and the request-steps
    # that verified a proposal (mean accepted length: 1 + accepted / verify steps)
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verify_steps: int = 0
    # static decode steps (engine/decode_graphs.py): those run on a CUDA graph or the compiled CPU step, and the
    # seconds the compiled step's start-up compile took
    static_decode_steps: int = 0
    decode_compile_seconds: float = 0.0
    role_switches: int = 0  # prefill <-> decode switches made in place (cluster/run/role_switch.py)
    # expert parallelism (engine/expert_parallel.py), rank 0's eager forwards: tokens through the mixture-of-experts
    # layers, the (token, expert) pairs the busiest rank's experts computed and a rank's mean, bytes rank 0 sent
    expert_tokens: int = 0
    expert_pairs_busiest_rank: int = 0
    expert_pairs_mean_rank: int = 0
    expert_bytes_sent: int = 0

    @property
    def expert_load_imbalance(self) -> float:
        """The busiest rank's routed pairs over the mean rank's (1.0: even; 0.0: no expert parallelism)."""
        mean = self.expert_pairs_mean_rank
        return self.expert_pairs_busiest_rank / mean if mean else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a verifying request gained per step (``engine.speculative.SpecTotals``'s figure)."""
        return 1.0 + self.spec_accepted_tokens / self.spec_verify_steps if self.spec_verify_steps else 0.0


# ---- commands: router -> worker --------------------------------------------------------------------------------


# a W3C traceparent (version 00): the router's span a request's work continues (worker/tracing.py)
TraceParent = Annotated[str, msgspec.Meta(pattern=r"^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")]


class _Command(msgspec.Struct, tag_field="type", kw_only=True, forbid_unknown_fields=True):
    router: Annotated[int, msgspec.Meta(ge=0)] = 0  # the sending router's index: a request's events go back there
    sent_at: float | None = None  # time.time() when sent (how long it sat in the socket; same-host clocks)
    # a request command's, when the router traces the request (observability.otlp_endpoint): its span's context
    trace: TraceParent | None = None


class _RequestCommand(_Command):
    rid: str


class _PromptCommand(_RequestCommand):
    prompt: list[int]
    params: SamplingParams  # validate()d by the worker on receipt


KV_ADDRESS_SEPARATOR = "|"  # a worker's KV address: each of its ranks' receivers, in rank order
# before them, ``1@`` when the worker's ranks each hold every KV head (its attention whole on every rank: its plan does
# not cut it, or the ranks split only a mixture's experts); else its ranks cut the heads as many ways as they are
WHOLE_HEADS_PREFIX = "1@"


class KVAddress(NamedTuple):
    """A worker's KV receivers, one per rank, and the ways its ranks cut the KV heads (len(ranks), or 1)."""

    ranks: list[str]
    degree: int


def join_kv_address(addresses: list[str], degree: int | None = None) -> str:
    joined = KV_ADDRESS_SEPARATOR.join(addresses)
    return WHOLE_HEADS_PREFIX + joined if degree == 1 and len(addresses) > 1 else joined


def split_kv_address(address: str) -> KVAddress:
    """Each rank's receiver address of a worker's ``kv_address``, and how its ranks cut the heads (ValueError naming
    it when it holds an empty one or more than 64)."""
    whole = address.startswith(WHOLE_HEADS_PREFIX)
    parts = address.removeprefix(WHOLE_HEADS_PREFIX).split(KV_ADDRESS_SEPARATOR)
    if any(not part for part in parts) or len(parts) > 64:
        raise ValueError(f"kv_address {address[:200]!r} is not one receiver address per rank joined by '|'")
    return KVAddress(parts, 1 if whole else len(parts))


class Reserve(_PromptCommand, tag="reserve"):
    """Hold decode KV for a request whose KV and tokens come from another worker (``Reserved`` answers): a prompt
    about to be prefilled, or (``context_tokens``) a running request about to move here from another decode worker."""

    # conditional disaggregation, decided where the cache is: when what this worker lacks of the prompt (after its
    # prefix cache) is at most this many tokens, it computes it itself at once (``Reserved.prefill_local``); 0: never
    local_prefill_max_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    # a move: the tokens whose KV the request holds now (its prompt and every generated token but the last); its KV
    # then fills a leading run of the reserved blocks, as many as it holds when its source stops it
    context_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    # reserved beyond the pool's headroom: a move's room for the tokens the request makes until its source stops it
    extra_headroom_tokens: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] = 0
    # the ways the worker the KV comes from cuts its heads over its ranks (its tensor degree; 1 when each rank holds
    # every head): each rank that holds a head first sends it to the ranks here that hold it (worker/rank_kv.py)
    source_degree: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1


class Prefill(_PromptCommand, tag="prefill"):
    kv_address: str  # the decode worker's KV receiver
    dst_blocks: list[int]  # the block ids it reserved for the KV, in order, from block cached_tokens // block_size on
    # the decode worker holds the prompt's first tokens up to here already (whole blocks; Reserved.cached_tokens):
    # only the blocks after them are sent
    cached_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0


class Export(_RequestCommand, tag="export"):
    """A move, on its source: the decoding request's KV goes to another decode worker's reserved blocks (transfer
    ``target_rid``, a leading run of ``dst_blocks``). With ``precopy`` its full blocks go while it decodes on; then it
    stops at a step boundary (``Frozen`` names its tokens, for the target's ``Start``) and the rest goes. Its blocks
    here are held until ``Abort`` (it moved) or ``Resume`` (the move was called off: it runs on here)."""

    target_rid: str
    kv_address: str
    dst_blocks: Annotated[list[int], msgspec.Meta(min_length=1)]
    precopy: bool = True


class Start(_RequestCommand, tag="start"):
    """The tokens a reservation waits for, made where its KV comes from: a prefill worker's first token, or every
    token a moved request generated (``Frozen``). Their text has been sent; the KV holds all but the last."""

    tokens: Annotated[list[int], msgspec.Meta(min_length=1)]


class Generate(_PromptCommand, tag="generate"):
    pass


class Abort(_RequestCommand, tag="abort"):
    pass


class Ping(_Command, tag="ping"):
    pass


class Drain(_Command, tag="drain"):
    """The worker is being removed (``pdserve scale``, cluster/run/scaling.py) or is switching role
    (cluster/run/role_switch.py): every router sends it once it routes nothing new there. The worker finishes what it
    holds; once every router has sent it and nothing is left, it says ``drained`` (the pool then stops or switches
    it). What a removed worker still holds ``deadline_s`` after the first one is failed with an explicit error, never
    dropped; a switching one (``fail_at_deadline`` false) keeps it: the switch is called off (``Undrain``)."""

    deadline_s: Annotated[float, msgspec.Meta(gt=0)]
    fail_at_deadline: bool = True


class Undrain(_Command, tag="undrain"):
    """A drain called off (a role switch that could not drain in its deadline): the worker serves on as before."""


class Resume(_RequestCommand, tag="resume"):
    """A move called off or cut short: the request runs on here with what it has. On the source, its export stops
    and it decodes on (frozen or not); on the target, the KV that has not come is computed here from its tokens."""


Command = Reserve | Prefill | Export | Start | Generate | Abort | Resume | Ping | Drain | Undrain


# ---- events: worker -> router ----------------------------------------------------------------------------------


class _Event(msgspec.Struct, tag_field="type", kw_only=True, forbid_unknown_fields=True):
    worker: str  # the sending worker's name


class Reserved(_Event, tag="reserved"):
    rid: str
    ok: bool
    blocks: list[int] = []  # ok: the reserved block ids the KV goes into (missing prompt blocks, first token, headroom)
    kv_address: str = ""  # ok: where the prefill worker sends the KV (each rank's receiver, joined by "|")
    reason: RefusalReason | None = None  # not ok: why
    cached_tokens: int = 0  # ok: the prompt's leading tokens the worker already holds (whole blocks, prefix cache)
    prefill_local: bool = False  # ok: the worker computes the rest itself (Reserve.local_prefill_max_tokens): no KV


class TokenItem(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One request's share of a step (``worker.role.token_item``): ``[rid, token ids, text, finish reason, timing,
    logprobs, prompt logprobs, cached tokens, index]`` on the wire (nil for the absent ones). A prefill worker's first token
    is one too: the router forwards it to the decode worker (``Start``)."""

    rid: str
    token_ids: list[int]
    text: str  # what the tokens add to the output, ready to send (held-back characters come later)
    finish_reason: FinishReason | None = None
    timing: Timing | None = None  # with the request's first token here, its first decoded one, and its last
    logprobs: list[TokenLogprob] | None = None  # params.logprobs set: one per token id
    # with the first token sampled where the prompt was computed: per prompt token (entry 0 None), and the prompt
    # tokens that worker's prefix cache held
    prompt_logprobs: list[TokenLogprob | None] | None = None
    cached_tokens: int | None = None
    # where its first token stands among the request's output tokens (0: the first): the router takes items only in
    # order, so a lost ``tokens`` message fails the request instead of leaving a hole in its text (None: unchecked)
    index: Annotated[int, msgspec.Meta(ge=0)] | None = None


class Tokens(_Event, tag="tokens"):
    items: list[TokenItem]


class ErrorEvent(_Event, tag="error"):
    rid: str
    message: str
    code: ErrorCode


class Stats(_Event, tag="stats"):
    """The heartbeat: several times a second, to every router, even while a long step holds the worker's loop."""

    role: Role
    address: str  # the worker's command address: which incarnation of the worker this is
    load: WorkerLoad
    counters: WorkerCounters
    degraded: str = ""  # why the worker should get no new work ("" when healthy)
    loop_age_s: float = 0.0  # how long ago the worker's loop last came round (slow vs stuck)
    draining: bool = False  # a router sent ``drain``: it is being removed or switching role
    epoch: int = 0  # role switches this process has made (each under a new command address)
    kv_paths: dict[str, str] = {}  # how its KV sender reaches each receiver (``KVSender.paths``)


MAX_KV_EVENT_HASHES = 2048  # hashes (stored + removed) in one KvEvents message; a larger batch is split


class KvEvents(_Event, tag="kv_events"):
    """What the worker's prefix cache gained and lost (engine/block_manager.py ``drain_kv_events``), to every router,
    batched once per loop turn and split at ``MAX_KV_EVENT_HASHES``. ``reset``: forget everything held before and
    take ``stored`` (and the messages after it) as the snapshot. ``seq`` counts this incarnation's messages from 0, so
    a reader that misses one knows (cluster/routing/prefix_index.py drops that worker's view until the next snapshot)."""

    address: str  # the worker's command address: which incarnation these hashes belong to
    seq: Annotated[int, msgspec.Meta(ge=0)]
    stored: Annotated[list[int], msgspec.Meta(max_length=MAX_KV_EVENT_HASHES)] = []
    removed: Annotated[list[int], msgspec.Meta(max_length=MAX_KV_EVENT_HASHES)] = []
    reset: bool = False
    # which of the worker's KV tiers the hashes are in; a reset forgets only this tier's view. Device hashes can be
    # attended now; host and disk ones are loaded back first (engine/kv_tiers.py), from this node's shared pool
    tier: Literal["device", "host", "disk"] = "device"


class Frozen(_Event, tag="frozen"):
    """A move's source stopped the request (``Export``) after ``output_token_ids``, every one already sent in a
    ``tokens`` event before this; the rest of its KV is on its way."""

    rid: str
    output_token_ids: Annotated[list[int], msgspec.Meta(min_length=1)]


Event = Reserved | Tokens | ErrorEvent | Stats | KvEvents | Frozen


# ---- encoding --------------------------------------------------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()
_command_decoder = msgspec.msgpack.Decoder(Command)
_event_decoder = msgspec.msgpack.Decoder(Event)


def encode(message: Command | Event) -> bytes:
    return _encoder.encode(message)


def decode_command(data: bytes | memoryview, max_bytes: int = MAX_MESSAGE_BYTES) -> Command:
    """The typed command, or MalformedMessage."""
    return _decode(_command_decoder, data, max_bytes)


def decode_event(data: bytes | memoryview, max_bytes: int = MAX_MESSAGE_BYTES) -> Event:
    """The typed event, or MalformedMessage."""
    return _decode(_event_decoder, data, max_bytes)


def _decode(decoder: msgspec.msgpack.Decoder, data: bytes | memoryview, max_bytes: int):
    if len(data) > max_bytes:
        raise MalformedMessage(f"control message of {len(data)} bytes exceeds {max_bytes}")
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:  # ValidationError is a DecodeError; both named
        raise MalformedMessage(f"invalid control message: {exc}") from None


def kind(message: Command | Event) -> str:
    """The message's wire name (its ``type``), for logs."""
    return message.__struct_config__.tag  # type: ignore[return-value]
