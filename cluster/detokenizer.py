"""The router's detokenizer: one per response stream, turning token events into text deltas for the client.

A thin wrapper over ``engine.detokenizer.IncrementalDetokenizer``, which decodes only a short window around the new
tokens (the whole output used to be re-decoded for every token: quadratic, about half the router's CPU with 64
streams). Half a UTF-8 character is held back until the next token completes it, and so are the last characters that
could still turn into a stop string; the text is cut at the earliest stop string.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.detokenizer import IncrementalDetokenizer


class Detokenizer:
    def __init__(self, tokenizer, stop: list[str]) -> None:
        self._inner = IncrementalDetokenizer(tokenizer, stop)

    def add(self, token_ids: Iterable[int], final: bool) -> str:
        """Append tokens; returns the text safe to send now (everything left, when final or stopped)."""
        return self._inner.add(token_ids, final)

    @property
    def stopped(self) -> bool:
        return self._inner.stopped

    @property
    def text(self) -> str:
        """All text settled so far, cut at a stop string."""
        return self._inner.text
