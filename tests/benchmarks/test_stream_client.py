"""The token-timed client of ``pdserve bench migrate``: what a chunk adds to a stream, and an error ending it."""

from __future__ import annotations

from benchmarks.stream_client import Stream, apply_chunk


def test_a_chunk_adds_its_tokens_at_the_time_it_was_read():
    s = Stream(0, "p", 3)
    apply_chunk(s, {"id": "cmpl-1", "choices": [{"text": "He", "logprobs": {"tokens": ["He"]}}], "usage": None}, 1.0)
    two = {"id": "cmpl-1", "choices": [{"text": "llo!", "logprobs": {"tokens": ["llo", "!"]}, "finish_reason": None}]}
    apply_chunk(s, two, 2.0)
    last = {"id": "cmpl-1", "choices": [{"text": "", "logprobs": None, "finish_reason": "length"}]}
    apply_chunk(s, last | {"usage": {"completion_tokens": 3}, "timing": {"migrations": 1}}, 2.5)
    assert (s.request_id, s.text, s.tokens, s.arrivals) == ("cmpl-1", "Hello!", ["He", "llo", "!"], [1.0, 2.0, 2.0])
    assert (s.chunks, s.completion_tokens, s.finish_reason, s.timing) == (2, 3, "length", {"migrations": 1})
    assert s.ended and s.error is None
    failed = Stream(1, "p", 3)
    apply_chunk(failed, {"error": {"message": "worker died"}}, 1.0)
    assert failed.ended and "worker died" in failed.error
