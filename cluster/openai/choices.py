"""One response, several router requests: ``n`` choices per prompt, and the prompts of a list.

Each choice is its own request with its own id (reservation, retries, abort, timing hold per choice); choice
``prompt_index * n + j`` is the j-th of that prompt. A prompt's first choice goes at once; the others follow its
first token (disaggregated: its second, proving the decode worker cached the prompt's blocks) or its end, with
``affinity`` = its id, so the prompt is computed once however large n is. Prompts of a list start at once.
``fan_out`` yields ``(choice index, TokenEvent)`` in arrival order. One choice failing fails the response (as in
vLLM) and aborts the others; closing the iterator aborts every choice. A single choice is iterated directly.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from cluster.routing.flow import TokenEvent
from cluster.routing.router import Router
from engine.request import SamplingParams


@dataclass(slots=True)
class ChoicePlan:
    index: int  # in the response: prompt_index * n + j
    prompt_index: int
    prompt: list[int]
    params: SamplingParams
    request_id: str
    leader: int | None = None  # the choice whose first event releases this one (its prompt's first choice)


def choice_id(rid: str, index: int) -> str:
    """The router's id of choice ``index``: the response's own id for choice 0."""
    return rid if index == 0 else f"{rid}-{index}"


async def fan_out(router: Router, plans: list[ChoicePlan]) -> AsyncGenerator[tuple[int, TokenEvent], None]:
    if len(plans) == 1:
        plan = plans[0]
        events = router.generate(plan.prompt, plan.params, plan.request_id)
        try:
            async for only in events:
                yield plan.index, only
        finally:
            await events.aclose()
        return
    by_index = {plan.index: plan for plan in plans}
    released = {plan.index: asyncio.Event() for plan in plans}
    # disaggregated: the leader's second token proves its decode worker cached the prompt's blocks; followers
    # released at the first token would each get their own copy
    tokens_to_release = 2 if router.config.mode == "disaggregated" else 1
    # bounded: a choice waits while the client is behind, so its stream at the router keeps coalescing
    queue: asyncio.Queue[tuple[int, TokenEvent | None, BaseException | None]] = asyncio.Queue(maxsize=len(plans))

    async def run(plan: ChoicePlan) -> None:
        affinity = None
        if plan.leader is not None:
            await released[plan.leader].wait()
            affinity = by_index[plan.leader].request_id
        events = router.generate(plan.prompt, plan.params, plan.request_id, affinity=affinity)
        num_tokens = 0
        try:
            async for event in events:
                num_tokens += event.num_tokens
                if num_tokens >= tokens_to_release or event.finish_reason is not None:
                    released[plan.index].set()
                await queue.put((plan.index, event, None))
            await queue.put((plan.index, None, None))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # RequestFailed, or anything else: the response fails with it
            await queue.put((plan.index, None, exc))
        finally:
            released[plan.index].set()  # followers go on even when the leader failed: the response ends anyway
            await events.aclose()

    tasks = [asyncio.create_task(run(plan)) for plan in plans]
    try:
        remaining = len(plans)
        while remaining:
            index, event, error = await queue.get()
            if error is not None:
                raise error
            if event is None:
                remaining -= 1
                continue
            yield index, event
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # every choice's abort has been sent
