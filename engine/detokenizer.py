"""Incremental detokenization: the text of new tokens in time proportional to them, not to the output.

As in vLLM, only a window ``ids[prefix:]`` is decoded: ``decode(ids[prefix:])`` minus ``decode(ids[prefix:read])`` is
what the new tokens add in context, and both decodes start with the same token, so a first-token rule cancels out.
The window advances when its text grew and does not end in U+FFFD (half a character). The joined deltas equal
``tokenizer.decode(ids, skip_special_tokens=...)`` (why, and the known limit: docs/engine.md).
"""

from __future__ import annotations

import logging
import re
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"  # what a decoder yields for an incomplete or invalid UTF-8 sequence

# transformers' PreTrainedTokenizerBase.clean_up_tokenization, in its order (each rule is one str.replace pass)
CLEANUP_RULES: tuple[tuple[str, str], ...] = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)
_PROBE = "a , b . c ! d ? e ' f n't g 'm h 's i 've j 're k"  # holds every pattern, to see whether decode cleans up


def clean_up(text: str) -> str:
    for pattern, replacement in CLEANUP_RULES:
        text = text.replace(pattern, replacement)
    return text


def _unsafe_runs() -> frozenset[str]:
    """Trailing non-space runs after which a cut may be spanned by a rewrite (see ``CleanUpStream``)."""
    runs: set[str] = set()
    for pattern, replacement in CLEANUP_RULES:
        # the proof needs: a pattern starts with a space, has none inside, and its rewrite only deletes spaces
        assert pattern[0] == " " and " " not in pattern[1:-1] and pattern.replace(" ", "") == replacement
        for end in range(1, len(pattern)):  # every proper prefix " " + tail
            tail = pattern[1:end]
            runs.update(tail[i:] for i in range(len(tail) + 1))
    return frozenset(runs)


_UNSAFE_RUNS = _unsafe_runs()  # {"", "'", "n", "n'", "v", "'v", "r", "'r"}
_RUN_CAP = max(map(len, _UNSAFE_RUNS)) + 1  # a longer run is safe: remembering this many characters decides it


class CleanUpStream:
    """``clean_up`` (``clean_up_tokenization_spaces``) of text arriving in pieces, emitted once it cannot change.

    Every rewrite deletes the leading space of ``" " + tail`` (tail without spaces) and nothing else, so the text
    before a cut keeps its trailing non-space run ``w`` through all ten passes, and a rewrite can span the cut only if
    ``w`` is a suffix of a proper prefix of a tail (``_UNSAFE_RUNS``); elsewhere ``clean_up(a + b) == clean_up(a) +
    clean_up(b)``. Each character is examined and cleaned once; text like " n n n ..." waits for a safe cut or the end.
    """

    def __init__(self) -> None:
        self.pending = ""  # raw text after the last safe cut
        self.run = ""  # the trailing non-space run of all raw text so far, its last _RUN_CAP characters

    def feed(self, raw: str, final: bool) -> str:
        start = len(self.pending)
        self.pending += raw
        run, cut = self.run, 0
        for i, char in enumerate(raw, start + 1):
            run = "" if char == " " else (run + char)[-_RUN_CAP:]
            if run not in _UNSAFE_RUNS:
                cut = i
        self.run = run
        if final:
            cut = len(self.pending)
        head, self.pending = self.pending[:cut], self.pending[cut:]
        return clean_up(head) if head else ""


@dataclass(frozen=True)
class TokenizerInfo:
    """What incremental decoding needs to know about one tokenizer, worked out once (``tokenizer_info``)."""

    decode: Callable[[list[int]], str]  # ids -> text, special tokens skipped (unless kept), no clean-up
    is_kept: Callable[[int], bool]  # False for ids that skip_special_tokens drops (when set) or the vocabulary lacks
    byte_ids: frozenset[int]  # byte-fallback tokens ("<0x41>") when the decoder merges them, else empty
    cleanup: bool  # whether tokenizer.decode applies clean_up_tokenization


_INFO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def tokenizer_info(tokenizer: Any, skip_special_tokens: bool = True) -> TokenizerInfo:
    """Cached per tokenizer object and ``skip_special_tokens`` (the tokenizer must not gain tokens afterwards)."""
    try:
        infos = _INFO[tokenizer]
    except KeyError:
        infos = _INFO[tokenizer] = {}
    except TypeError:  # not weak-referenceable or hashable: work it out every time
        return _build_info(tokenizer, skip_special_tokens)
    info = infos.get(skip_special_tokens)
    if info is None:
        info = infos[skip_special_tokens] = _build_info(tokenizer, skip_special_tokens)
    return info


def _build_info(tokenizer: Any, skip_special_tokens: bool = True) -> TokenizerInfo:
    """``skip_special_tokens=False`` keeps special tokens' text: only ids the vocabulary lacks are dropped."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "id_to_token"):  # a fast (Rust `tokenizers`) tokenizer
        special: frozenset[int] = frozenset()
        if skip_special_tokens:
            special = frozenset(i for i, t in tokenizer.added_tokens_decoder.items() if getattr(t, "special", False))
        id_to_token = backend.id_to_token

        def decode(ids: list[int]) -> str:
            return backend.decode(ids, skip_special_tokens=skip_special_tokens)

        def is_kept(token_id: int) -> bool:
            return token_id >= 0 and token_id not in special and id_to_token(token_id) is not None

        byte_ids: frozenset[int] = frozenset()
        if "ByteFallback" in repr(backend.decoder):
            vocab = backend.get_vocab(with_added_tokens=False)
            byte_ids = frozenset(i for t, i in vocab.items() if _BYTE_TOKEN.fullmatch(t))
    else:
        special = frozenset(getattr(tokenizer, "all_special_ids", ())) if skip_special_tokens else frozenset()
        size = len(tokenizer)

        def decode(ids: list[int]) -> str:
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

        def is_kept(token_id: int) -> bool:
            return 0 <= token_id < size and token_id not in special

        byte_ids = frozenset()
    return TokenizerInfo(decode, is_kept, byte_ids, _cleans_up(tokenizer, decode, skip_special_tokens))


def _cleans_up(tokenizer: Any, raw_decode: Callable[[list[int]], str], skip_special_tokens: bool = True) -> bool:
    """Whether ``tokenizer.decode`` cleans up, asked of the tokenizer (transformers versions differ on BPE); one
    that overrides ``clean_up_tokenization`` gets transformers' standard rules."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    try:
        ids = list(tokenizer.encode(_PROBE, add_special_tokens=False))
        raw, full = raw_decode(ids), tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    except Exception:  # noqa: BLE001 - a tokenizer that cannot take the probe: trust its setting
        return True
    if clean_up(raw) == raw:  # the probe's patterns did not survive encoding: nothing to tell
        return True
    if full not in (raw, clean_up(raw)):
        logger.warning(
            "%s cleans up tokenization spaces its own way; streaming applies transformers' rules",
            type(tokenizer).__name__,
        )
    return full != raw


class _Window:
    """The prefix/read offsets over the kept ids: ``push`` returns the raw text the new ids settle.

    Special tokens and ids outside the vocabulary are dropped before decoding (as ``skip_special_tokens``); the window
    always holds the token emitted last, so a first-token rule hits the same token in both decodes. A byte-fallback
    run (``<0xE2>``) is held while open: the decoder makes every byte of a run invalid as a whole into U+FFFD."""

    def __init__(self, info: TokenizerInfo) -> None:
        self.info = info
        self.ids: list[int] = []
        self.prefix = 0  # window start: the first token whose text was emitted last
        self.read = 0  # tokens whose text has been emitted
        self.prefix_len = 0  # len(decode(ids[prefix:read]))

    def push(self, token_ids: list[int], final: bool) -> str:
        info = self.info
        kept = [t for t in token_ids if info.is_kept(t)]
        self.ids.extend(kept)
        if len(self.ids) == self.read or (not final and (not kept or kept[-1] in info.byte_ids)):
            return ""  # nothing new, or a byte-fallback run still open
        text = info.decode(self.ids[self.prefix :])
        if final:
            self.prefix = self.read = len(self.ids)
            delta, self.prefix_len = text[self.prefix_len :], 0
            return delta
        if len(text) <= self.prefix_len or text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing visible yet, or half a character: decode again with the next token
        delta = text[self.prefix_len :]
        self.prefix, self.read = self.read, len(self.ids)
        self.prefix_len = len(info.decode(self.ids[self.prefix : self.read]))
        return delta


class IncrementalDetokenizer:
    """One output stream's text: ``add`` token ids as they come, get back the text that is safe to show now.

    ``text`` is the text settled so far, ``stopped`` says a stop string was found. Stop strings are searched in the
    new text plus the ``hold`` characters before it, which are held back until they cannot start one. The cut is
    where the first stop string to complete starts (of two ending together, the longer), as a per-character check
    would find, so it is the same however tokens are grouped into calls (the engine's one, the router's many).
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), skip_special_tokens: bool = True) -> None:
        info = tokenizer_info(tokenizer, skip_special_tokens)
        self._window = _Window(info)
        self._cleanup = CleanUpStream() if info.cleanup else None
        self.stop = tuple(s for s in stop if s)
        self.hold = max(map(len, self.stop), default=1) - 1  # trailing characters that may start a stop string
        self.num_tokens = 0  # token ids given to add, special ones included
        self.stopped = False
        self.finished = False
        self._emitted: list[str] = []
        self._pending = ""  # settled text not emitted yet (at most `hold` characters between calls)

    @property
    def text(self) -> str:
        if len(self._emitted) > 1:
            self._emitted = ["".join(self._emitted)]
        return (self._emitted[0] if self._emitted else "") + self._pending

    def add(self, token_ids: Iterable[int], final: bool = False) -> str:
        """Append tokens; returns the text safe to send now (everything left, when final or stopped)."""
        token_ids = list(token_ids)
        self.num_tokens += len(token_ids)
        if self.finished:
            return ""
        new = self._window.push(token_ids, final)
        if self._cleanup is not None:
            new = self._cleanup.feed(new, final)
        region = self._pending + new
        if self.stop and new:
            start = max(0, len(self._pending) - self.hold)  # a stop found before would have ended the stream
            hits = [(i + len(s), i) for s in self.stop if (i := region.find(s, start)) >= 0]
            if hits:  # the first stop string to end; of two ending together, the longer
                region, self.stopped, final = region[: min(hits)[1]], True, True
        end = len(region) if final else max(0, len(region) - self.hold)
        delta, self._pending = region[:end], region[end:]
        if delta:
            self._emitted.append(delta)
        self.finished = final
        return delta
