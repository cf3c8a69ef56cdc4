"""A flow's log probabilities and prefix-cache hit (cluster/routing/flow.py), and through the router.

Unit level: a flow coalesces what several worker items brought into one event, each event's ``logprobs`` are exactly
its tokens' (so the API can put a token's logprobs in the chunk that carries its text), the prompt's logprobs and
cached tokens come once, with the first token, and a request that asked for none gets None everywhere.
Through the router (the in-process cluster, both modes): the figures the workers computed reach ``generate``'s
events, aligned with the tokens and the same in both modes; a request a worker refuses for its parameters is a 400.
"""

from __future__ import annotations

import asyncio
import math

import pytest

from cluster.routing.errors import RequestFailed
from cluster.routing.flow import Flow
from engine.request import FinishReason, GuidedDecoding, SamplingParams, TokenLogprob
from worker.messages import TokenItem

# ---- the flow alone ---------------------------------------------------------------------------------------------


def _lp(token: int) -> TokenLogprob:
    return TokenLogprob(token, -0.1 * token, [(token, -0.1 * token)])


def _flow() -> Flow:
    return Flow("r", [1, 2, 3, 4], SamplingParams(), [], started_s=0.0, deadline_s=60.0)


def _item(ids, text, finish=None, logprobs=None, prompt_logprobs=None, cached=None) -> TokenItem:
    return TokenItem("r", ids, text, FinishReason(finish) if finish else None, None, logprobs, prompt_logprobs, cached)


def test_coalesced_events_keep_each_tokens_logprobs_with_it():
    flow = _flow()
    prompt = [None, _lp(100), _lp(101), _lp(102)]
    assert flow.push(_item([1], "a", None, [_lp(1)], prompt, 16), 1.0)  # the first token: the prompt's figures
    assert flow.push(_item([2, 3], "bc", None, [_lp(2), _lp(3)]), 1.1)
    first = flow.take()
    assert (first.text, first.num_tokens) == ("abc", 3) and flow.first_token_s == 1.0
    assert [lp.token_id for lp in first.logprobs] == [1, 2, 3]
    assert first.prompt_logprobs == prompt and first.cached_tokens == 16
    assert flow.push(_item([], "", None, []), 1.2)  # a step that brought no token: no entries, still aligned
    assert flow.push(_item([4], "d", None, [_lp(4)], [None, _lp(9)], 99), 1.3)  # not the first: prompt figures drop
    assert flow.push(_item([5, 6], "ef", "length", [_lp(5), _lp(6)]), 1.4)
    second = flow.take()
    assert (second.text, second.num_tokens, second.finish_reason) == ("def", 3, "length") and flow.finished
    assert [lp.token_id for lp in second.logprobs] == [4, 5, 6]
    assert second.prompt_logprobs is None and second.cached_tokens is None
    assert flow.take() is None and not flow.push(_item([7], "late"), 1.5)  # nothing after the finish counts


def test_an_event_without_tokens_has_no_logprobs_and_a_request_that_asked_none_gets_none():
    flow = _flow()
    flow.push(_item([1], "x", None, [_lp(7)], None, 0), 0.1)
    assert flow.take().logprobs == [_lp(7)]
    flow.push(_item([], "held", "stop"), 0.2)  # the held-back text at the finish: no token, so no logprobs
    event = flow.take()
    assert event.text == "held" and event.logprobs == [] and event.cached_tokens is None
    plain = _flow()
    plain.push(_item([1], "a"), 0.1)
    plain.push(_item([2, 3, 4], "bcd", "stop"), 0.2)
    event = plain.take()
    assert event.num_tokens == 4 and event.logprobs is None and event.prompt_logprobs is None
    assert event.cached_tokens is None and plain.received_tokens == 4
    assert plain.pending_logprobs is None  # nothing allocated for the request that asked for none


def test_logprobs_that_do_not_match_their_tokens_fail_the_flow_after_the_text_before_them():
    flow = _flow()
    flow.push(_item([1], "a", None, [_lp(1)]), 0.1)
    assert not flow.push(_item([2, 3], "bc", None, [_lp(2)]), 0.2)  # one entry for two tokens: never shifted
    event = flow.take()
    assert (event.text, [lp.token_id for lp in event.logprobs]) == ("a", [1])
    assert flow.take() is None and flow.error.code == "worker_error"


def test_a_new_dispatch_forgets_the_old_ones_logprobs_and_takes_the_new_first_tokens_figures():
    flow = _flow()
    flow.push(_item([1], "a", None, [_lp(1)], [None, _lp(5)], 0), 0.1)
    flow.reset()
    assert flow.pending_logprobs is None and flow.pending_prompt_logprobs is None and flow.first_token_s is None
    flow.push(_item([2], "b", "stop", [_lp(2)], [None, _lp(6)], 16), 0.2)
    event = flow.take()
    assert event.logprobs == [_lp(2)] and event.prompt_logprobs == [None, _lp(6)] and event.cached_tokens == 16


# ---- through the router -----------------------------------------------------------------------------------------


def collect(handle, prompt: list[int], params: SamplingParams, rid: str, affinity: str | None = None) -> list:
    """``Router.generate``'s events for one request, run on the router's own loop (the API's caller's view)."""

    async def run() -> list:
        return [event async for event in handle.router.generate(prompt, params, rid, affinity=affinity)]

    return asyncio.run_coroutine_threadsafe(run(), handle.router.loop).result(timeout=120)


PROMPT = list(range(5, 45))  # 40 tokens: two full blocks of 16 and a partial one


@pytest.fixture(params=["colocated", "disaggregated"])
def mode(request):
    return request.param


def test_logprobs_prompt_logprobs_and_cached_tokens_reach_the_router_aligned_with_the_tokens(serve):
    """Needs the engine's logprobs (issue 14's engine work). Both modes give one engine's figures: the first token's
    and the prompt's from the worker that computed the prompt, the rest from the one that decoded."""
    results = {}
    for mode in ("colocated", "disaggregated"):
        handle = serve(mode=mode)
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
        events = collect(handle, PROMPT, params, f"{mode}-a")
        assert sum(e.num_tokens for e in events) == 8 and events[-1].finish_reason == "length"
        assert all(e.logprobs is not None and len(e.logprobs) == e.num_tokens for e in events)
        [first] = [e for e in events if e.cached_tokens is not None]
        assert first is events[0] and first.cached_tokens == 0  # nothing cached yet
        assert len(first.prompt_logprobs) == len(PROMPT) and first.prompt_logprobs[0] is None
        assert [lp.token_id for lp in first.prompt_logprobs[1:]] == PROMPT[1:]
        assert all(len(lp.top) == 2 for lp in first.prompt_logprobs[1:])
        logprobs = [lp for e in events for lp in e.logprobs]
        assert all(len(lp.top) == 3 and lp.top[0][0] == lp.token_id for lp in logprobs)  # greedy: the likeliest
        results[mode] = (first.prompt_logprobs[1:], logprobs)
        # the same prompt again, on the same workers: the one that computes it finds its two full blocks cached
        plain_params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        plain = collect(handle, PROMPT, plain_params, f"{mode}-b", affinity=f"{mode}-a")
        assert all(e.logprobs is None and e.prompt_logprobs is None for e in plain)
        assert plain[0].cached_tokens == 32
    colocated, disaggregated = results["colocated"], results["disaggregated"]
    for ours, theirs in zip(colocated[0] + colocated[1], disaggregated[0] + disaggregated[1], strict=True):
        assert ours.token_id == theirs.token_id and math.isclose(ours.logprob, theirs.logprob, abs_tol=1e-4)


def test_a_request_a_worker_refuses_for_its_parameters_is_a_400(serve, mode):
    """The router checks nothing of the parameters here (the API does): the worker's ``invalid_request`` must
    reach the caller as a 400, not a timeout, in both modes (decode side: at the reservation; prefill side, or the
    colocated worker: when the engine takes the request). The grammar case needs the engine's structured outputs."""
    handle = serve(mode=mode)
    bad_value = SamplingParams(max_tokens=4, top_p=2.0)  # the worker's validate() refuses it
    bad_grammar = SamplingParams(max_tokens=4, guided=GuidedDecoding("regex", "(unclosed"))  # does not compile
    for index, params in enumerate([bad_value, bad_grammar]):
        with pytest.raises(RequestFailed) as failure:
            collect(handle, PROMPT, params, f"bad-{index}")
        assert failure.value.status == 400 and failure.value.code == "invalid_request", failure.value
    events = collect(handle, PROMPT, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), "good")
    assert sum(e.num_tokens for e in events) == 3  # the workers keep serving
