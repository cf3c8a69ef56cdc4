"""When a decoding request moves to another decode worker, and where: the policy half of a move.

A move is the KV hand-off again, with a decoding request as its source; the router core runs it as it runs a
prefill's (core.py: reserve on the target, ``Export`` from the source, ``Start`` with its tokens). What is decided
here: where it may go (another live decode worker with room for its context, ordered by the decode policy) and,
for rebalancing, which request leaves a decode worker about to preempt, and for which worker. Moves start for an
admin's ask (POST /admin/migrate), a drain (a worker being removed) or rebalancing.
"""

from __future__ import annotations

from collections.abc import Sequence

from cluster.routing.flow import Flow, FlowStatus
from cluster.routing.membership import WorkerHandle, free_blocks
from cluster.routing.placement import Placer
from worker.messages import Stats

# the target reserves this many tokens beyond the context the router saw: what the request may make on its source
# until it stops there (the reservation's round trip, a few of the source's steps, and with a pre-copy its four
# steps more). A source whose request would outgrow them stops it sooner (its pre-copy cut short), never later.
PRECOPY_SLACK_TOKENS = 16
STOP_SLACK_TOKENS = 4


def slack_tokens(precopy: bool) -> int:
    return PRECOPY_SLACK_TOKENS if precopy else STOP_SLACK_TOKENS


def computed_tokens(flow: Flow) -> int:
    """The tokens a decoding flow's KV holds: its prompt and every output token but the newest."""
    return len(flow.prompt) + flow.received_tokens - 1


def blocks_needed(placer: Placer, flow: Flow, precopy: bool) -> int:
    """What a target reserves for a decoding flow (``KVImporter.reserve`` with its context): its context so far, as
    a prompt, the tokens still to come, and the slack for those it makes until its source stops it."""
    remaining = flow.params.max_tokens - flow.received_tokens
    return placer.blocks_needed(computed_tokens(flow), remaining + 1, extra_headroom=slack_tokens(precopy))


def pick_target(flow: Flow, others: Sequence[WorkerHandle], placer: Placer, precopy: bool) -> WorkerHandle | None:
    """Of the other live decode workers, the one the decode policy ranks first among those with room for the flow's
    context; None when none has room."""
    needed = blocks_needed(placer, flow, precopy)
    fits = [w for w in others if free_blocks(w) >= needed]
    return placer.order("decode", fits, placer.prefix_match(0, []))[0] if fits else None


def rebalance_pick(
    worker: WorkerHandle, stats: Stats, others: Sequence[WorkerHandle], placer: Placer, max_moves: int
) -> tuple[Flow, WorkerHandle] | None:
    """A decode worker about to preempt (fewer free blocks than running requests) moves the request with the most
    tokens to go to the worker with the most room, if that one holds it and stays above the same line; at most
    ``max_moves`` at once off one worker."""
    load = stats.load
    if load.free_blocks >= load.running or load.running < 2:
        return None
    mine = [f for f in worker.flows if f.decode == worker.name]
    if sum(1 for f in mine if f.move is not None) >= max_moves:
        return None
    decoding = [f for f in mine if f.status is FlowStatus.DECODING]
    if not decoding:
        return None
    flow = max(decoding, key=lambda f: f.params.max_tokens - f.received_tokens)
    needed = blocks_needed(placer, flow, precopy=False)
    roomy = [w for w in others if w.stats is not None and free_blocks(w) - needed >= w.stats.load.running + 1]
    return (flow, max(roomy, key=free_blocks)) if roomy else None
