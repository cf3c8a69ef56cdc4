"""The colocated role, driven directly: ``generate`` in, ``tokens`` events out (no sockets; tests/helpers/roles.py).

Issue 14's fields on the wire: each item's logprobs are one per token id; the item with the request's first token
carries the prompt's logprobs and the prompt tokens the prefix cache held; the figures are the same as the
disaggregated hand-off's (prefill role's first token, decode role's rest); a request that asked for none carries
none; a request whose parameters the engine refuses is refused by ``handle`` (the runtime answers invalid_request).
Needs the engine's logprobs and structured outputs (issue 14's engine work). Every test ends with nothing held.
"""

from __future__ import annotations

import time

import pytest

from engine.request import GuidedDecoding
from tests.helpers.engine import random_prompts
from tests.helpers.roles import EventLog, RolePairs, assert_same_logprobs, build_engine, greedy
from worker.colocated import ColocatedRole
from worker.messages import Generate, TokenItem


@pytest.fixture
def colocated(tiny_llama_path):
    log = EventLog()
    return ColocatedRole("colocated-0", build_engine(tiny_llama_path), log), log


def _run(role: ColocatedRole, log: EventLog, rid: str, prompt: list[int], params) -> list[TokenItem]:
    role.handle(Generate(rid=rid, prompt=list(prompt), params=params.copy()), time.monotonic())
    deadline = time.monotonic() + 60
    while not any(item.finish_reason is not None for item in log.items(rid)):
        assert time.monotonic() < deadline and not log.errors(), log.events[-3:]
        role.tick()
    return log.items(rid)


def test_items_carry_logprobs_and_the_first_one_the_prompts_and_the_cache_hit(colocated, tiny_llama_path):
    role, log = colocated
    [prompt] = random_prompts(1, 40, 40, seed=71)  # two full blocks of 16 and a partial one
    params = greedy(7, logprobs=2, prompt_logprobs=3)
    first, *rest = _run(role, log, "a", prompt, params)
    assert len(first.token_ids) == 1 and first.cached_tokens == 0
    assert first.prompt_logprobs[0] is None and [lp.token_id for lp in first.prompt_logprobs[1:]] == prompt[1:]
    assert all(item.prompt_logprobs is None and item.cached_tokens is None for item in rest)
    items = [first, *rest]
    assert all(len(item.logprobs or []) == len(item.token_ids) for item in items)
    logprobs = [lp for item in items for lp in item.logprobs or []]
    assert [lp.token_id for lp in logprobs] == [t for item in items for t in item.token_ids]
    # the disaggregated hand-off gives the same figures: the first token's and the prompt's from the prefill role
    with RolePairs(tiny_llama_path) as pairs:
        pair = pairs.make()
        handed_off, _ = pair.handoff("a", prompt, params)
        assert_same_logprobs(first.prompt_logprobs, handed_off.prompt_logprobs)
        assert_same_logprobs(logprobs, pair.client_logprobs("a"))
        pair.settle()
        pair.check_no_leaks()
    # again without logprobs: nothing of them on the wire, and the prompt's full blocks came from the prefix cache
    first, *rest = _run(role, log, "b", prompt, greedy(3))
    assert first.cached_tokens == 32 and first.prompt_logprobs is None
    assert all(item.logprobs is None for item in [first, *rest])
    assert not role.engine.has_unfinished()
    role.engine.check_no_leaks()


def test_a_grammar_that_does_not_compile_is_refused_when_the_request_arrives(colocated):
    role, log = colocated
    params = greedy(4, guided=GuidedDecoding("regex", "(unclosed"))
    with pytest.raises(ValueError):  # the runtime answers invalid_request: the client's 400
        role.handle(Generate(rid="bad", prompt=[5, 6, 7], params=params), time.monotonic())
    assert not role.engine.requests and log.events == []
    role.engine.check_no_leaks()
