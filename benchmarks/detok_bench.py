"""``pdserve bench detok``: the detokenizer's cost per token as a stream grows, full re-decoding against incremental.

``FullRedecodeBaseline`` re-decodes the whole output per token (quadratic in total); the workers' incremental
detokenizer (``engine.detokenizer``) decodes a window of a few tokens (linear). Each length streams that many tokens
of a real text (English, accented Latin, CJK, emoji: multi-byte characters over several tokens) one at a time through
both, with a stop string that never matches (stop strings are searched on every token). Tokenizer: the default
model's (``--tiny``: the tiny model's byte-level one). Figures: the streaming thread's CPU time (a wait for a core is
not counted), the minimum over ``--repeats``; both must produce ``tokenizer.decode``'s text, or the bench fails.

    pdserve bench detok --json            # {"us_per_token": {"full_redecode": {...}, "incremental": {...}}, ...}
"""

from __future__ import annotations

import argparse
import time
from typing import Any

TEXT = (
    "The quick brown fox jumps over the lazy dog, and then it rests under the old oak tree. "
    "Café crème, naïve façade, déjà vu: Zürich, Kraków, São Paulo. "
    "日本語のテキストと中文文本，还有한국어. Emoji too: 😀 🎉 👍🏽. "
    "Numbers like 3.14159 and 2,718 sit beside symbols such as #, @, % and &. "
)
STOP = ["<never appears in this text>"]


class FullRedecodeBaseline:
    """BASELINE ONLY: decodes all tokens so far on every ``add`` (quadratic)."""

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def add(self, token_ids: list[int], final: bool) -> str:
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a model folder or the built-in default model's name")
    parser.add_argument("--tiny", action="store_true", help="use the tiny test model's byte-level tokenizer")
    parser.add_argument("--lengths", default="1000,2000,4000", help="stream lengths in tokens")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print the JSON object on one line")


def stream_ids(tokenizer: Any, length: int) -> list[int]:
    """``TEXT`` repeated, so multi-byte characters are split over tokens throughout."""
    unit = list(tokenizer.encode(TEXT, add_special_tokens=False))
    return (unit * (length // len(unit) + 1))[:length]


def _stream(detokenizer: Any, ids: list[int]) -> tuple[float, str]:
    """CPU seconds (this thread's) to feed ``ids`` one at a time, and the text the deltas make."""
    parts = []
    last = len(ids) - 1
    started = time.thread_time()
    for i, token_id in enumerate(ids):
        parts.append(detokenizer.add([token_id], final=i == last))
    return time.thread_time() - started, "".join(parts)


def measure(tokenizer: Any, lengths: list[int], repeats: int = 3) -> dict:
    """CPU microseconds per token for each method and length; raises if the two methods' texts ever differ."""
    from engine.detokenizer import IncrementalDetokenizer

    methods = {"full_redecode": FullRedecodeBaseline, "incremental": IncrementalDetokenizer}
    us: dict[str, dict[str, float]] = {name: {} for name in methods}
    for length in lengths:
        ids = stream_ids(tokenizer, length)
        expected = tokenizer.decode(ids, skip_special_tokens=True)
        for name, cls in methods.items():
            best = float("inf")
            for _ in range(max(1, repeats)):
                seconds, text = _stream(cls(tokenizer, list(STOP)), ids)
                if text != expected:
                    raise AssertionError(f"{name} produced different text at length {length}")
                best = min(best, seconds)
            us[name][str(length)] = max(round(best / length * 1e6, 2), 0.01)  # a coarse clock never gives 0
    first, last = str(lengths[0]), str(lengths[-1])
    return {
        "lengths": list(lengths),
        "us_per_token": us,
        "speedup": {k: round(us["full_redecode"][k] / us["incremental"][k], 1) for k in us["incremental"]},
        # cost per token at the longest length over the shortest: ~1 is linear total time, ~last/first quadratic
        "growth": {name: round(values[last] / values[first], 2) for name, values in us.items()},
        "identical_text": True,
    }


def run(args: argparse.Namespace) -> dict:
    lengths = [int(x) for x in str(args.lengths).split(",") if x.strip()]
    if not lengths or min(lengths) <= 0:
        raise ValueError("--lengths must be positive integers, e.g. 1000,2000,4000")
    if args.tiny:
        from engine.tiny_model import build_byte_tokenizer

        tokenizer, name = build_byte_tokenizer(), "tiny byte-level"
    else:
        from engine.model_loader import DEFAULT_MODEL, load_tokenizer

        name = args.model or DEFAULT_MODEL
        tokenizer = load_tokenizer(name)
    result = measure(tokenizer, lengths, args.repeats)
    return {"tokenizer": name, "repeats": args.repeats, **result}


if __name__ == "__main__":
    import json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    print(json.dumps(run(parser.parse_args())))
