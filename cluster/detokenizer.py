"""Incremental detokenization with stop strings, at the router.

Text is re-decoded from all tokens so far (tokenizers merge bytes across tokens, so per-token decoding is wrong for
multi-byte characters); a trailing U+FFFD (half a UTF-8 character) is held back until the next token completes it,
and so are the last characters that could still turn into a stop string.
"""

from __future__ import annotations


class Detokenizer:
    def __init__(self, tokenizer, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def add(self, token_ids: list[int], final: bool) -> str:
        """Append tokens; returns the text safe to send now (everything left, when final or stopped)."""
        if self.stopped:
            return ""
        self.token_ids.extend(token_ids)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if self.stop:
            start = max(0, self.emitted - self.hold)
            hits = [i for s in self.stop if (i := text.find(s, start)) >= 0]
            if hits:
                text, self.stopped, final = text[: min(hits)], True, True
        self.text = text
        end = len(text)
        if not final:
            while end > self.emitted and text[end - 1] == "\ufffd":
                end -= 1
            end = max(self.emitted, end - self.hold)
        delta = text[self.emitted : end]
        self.emitted = end
        return delta
