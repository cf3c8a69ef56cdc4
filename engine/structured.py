"""Structured output: the grammar a request's text must match, as a per-step token mask (xgrammar, on the CPU).

Per step each constrained request's ``GrammarState`` fills a bitmask row, ``apply_bitmask`` masks the batch's logits,
and the sampled token is fed back (``accept``). The state is just the tokens accepted, so a decode worker reaches the
prefill worker's state by accepting the tokens already sampled. Compiling costs tens to hundreds of ms (a schema
against a 150k vocabulary), so compilers are cached per (tokenizer, vocab width, stop ids), weakly, each with an LRU
of grammars (xgrammar's own cache is off: one bound). The API compiles too, so a bad schema is a 400 at the door.
JSON has fixed separators (``any_whitespace=False``): with free whitespace a small model may emit newlines forever.
``json_object`` is the schema ``{"type": "object"}``: OpenAI promises an object; xgrammar's JSON grammar allows arrays.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xgrammar as xgr

from engine.request import GuidedDecoding

GRAMMAR_CACHE_SIZE = 128  # compiled grammars kept per compiler (LRU); each holds per-state token masks
_JSON_OBJECT_SCHEMA = '{"type": "object"}'  # OpenAI json_object: any JSON object (not an array, not a scalar)
# a bounded-length JSON string character as xgrammar 0.2 prints it (control characters get through), and the class
# JSON allows (no quote, no backslash, nothing below 0x20), in xgrammar's EBNF spelling
_BOUNDED_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\"\\\0-\x1f]"
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " and sometimes "Check failed: (...) is false: "
_XGR_PREFIX = re.compile(r"^\s*(\[[\d:]+\]\s*\S+:\d+:\s*)?(Check failed: .*? is false:\s*)?")


class GrammarError(ValueError):
    """A spec that does not compile (bad schema, regex or EBNF): the request's 400, with what is wrong."""


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    """A grammar compiled for one tokenizer and vocabulary width: shareable, immutable, cheap to start a state from."""

    guided: GuidedDecoding
    vocab_size: int  # the model's logits width: the bitmask covers exactly this many ids
    compiled: Any  # xgrammar.CompiledGrammar


class GrammarState:
    """One request's position in its grammar; not thread-safe (one request, one engine loop)."""

    __slots__ = ("grammar", "_matcher")

    def __init__(self, compiled: CompiledGrammar) -> None:
        self.grammar = compiled
        self._matcher = xgr.GrammarMatcher(compiled.compiled)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (from ``allocate_bitmask``). Stop tokens are allowed
        only where the grammar is complete, special tokens never. Once the grammar has ended (e.g. ignore_eos) only
        the stop tokens are: xgrammar would raise, failing the whole batch's step for one request."""
        if not self._matcher.is_terminated():
            self._matcher.fill_next_token_bitmask(bitmask, row)
            return
        words = [0] * bitmask.shape[-1]
        for token_id in self._matcher.stop_token_ids:
            if token_id < len(words) * 32:
                words[token_id // 32] |= 1 << (token_id % 32)
        bitmask[row] = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token. False (state unchanged): the token breaks the grammar, is out of range, is
        a special non-stop token, or comes after the grammar ended; the caller ends the request."""
        return bool(self._matcher.accept_token(token_id))

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many leading tokens of a proposal the grammar would accept from here (its state is left unchanged)."""
        accepted = 0
        for token_id in token_ids:
            if not self._matcher.accept_token(token_id):
                break
            accepted += 1
        if accepted:
            self._matcher.rollback(accepted)
        return accepted

    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: nothing more may be generated."""
        return bool(self._matcher.is_terminated())

    def allows_eos(self) -> bool:
        """The text so far is a complete match, so a stop token would be accepted now."""
        return not self._matcher.is_terminated() and bool(self._matcher.is_completed())


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """An int32 CPU bitmask ``[num_rows, ceil(vocab_size / 32)]``, every token allowed (all bits set)."""
    return xgr.allocate_token_bitmask(num_rows, vocab_size)


_cuda_backend = "triton"  # xgrammar's CUDA kernel; falls back to plain torch once if triton is unusable here


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set to -inf, in place, the logits the grammars forbid: bitmask row i masks logits row ``rows[i]``; other rows
    are untouched. Ids past the bitmask's width are forbidden too, so a padding id is never sampled."""
    global _cuda_backend
    if not rows:
        return
    width = bitmask.shape[-1]
    # xgrammar's ``indices`` pick the same row of logits and bitmask: spread our compact rows over a full-height mask
    full = xgr.allocate_token_bitmask(logits.shape[0], width * 32)  # all set (torch.full is far slower here)
    full[rows] = bitmask[: len(rows)]
    vocab = min(logits.shape[-1], width * 32)
    if logits.shape[-1] > vocab:
        logits[rows, vocab:] = float("-inf")
    if logits.device.type == "cpu":
        xgr.apply_token_bitmask_inplace(logits, full, vocab_size=vocab, indices=rows, backend="cpu")
        return
    full = full.to(logits.device, non_blocking=True)
    if _cuda_backend == "triton" and logits.device.type == "cuda":
        try:
            xgr.apply_token_bitmask_inplace(logits, full, vocab_size=vocab, indices=rows, backend="triton")
            return
        except Exception:  # no triton (or it cannot compile here): the torch kernel is equivalent
            _cuda_backend = "torch_native"
    xgr.apply_token_bitmask_inplace(logits, full, vocab_size=vocab, indices=rows, backend="torch_native")


# ---- compiling -------------------------------------------------------------------------------------------------------


class _Compiler:
    """One tokenizer's xgrammar compiler and its LRU (thread-safe: the API and the engine compile from different
    threads; the compile itself runs outside the lock)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int] | None) -> None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self.lock = threading.Lock()

    def get(self, guided: GuidedDecoding) -> CompiledGrammar:
        key = (guided.kind, guided.spec)
        with self.lock:
            hit = self.cache.get(key)
            if hit is not None:
                self.cache.move_to_end(key)
                return hit
        compiled = CompiledGrammar(GuidedDecoding(guided.kind, guided.spec), self.vocab_size, self._compile(guided))
        with self.lock:
            self.cache[key] = compiled
            self.cache.move_to_end(key)
            while len(self.cache) > GRAMMAR_CACHE_SIZE:
                self.cache.popitem(last=False)
        return compiled

    def _compile(self, guided: GuidedDecoding) -> Any:
        kind, spec = guided.kind, guided.spec
        try:
            if kind == "json_object":
                return self.compiler.compile_json_schema(_JSON_OBJECT_SCHEMA, any_whitespace=False, strict_mode=False)
            if kind == "json_schema":
                _check_schema_text(spec)
                return self._compile_json_schema(spec)
            if kind == "regex":
                return self.compiler.compile_regex(spec)
            if kind == "ebnf":
                return self.compiler.compile_grammar(spec)
        except GrammarError:
            raise
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar raises RuntimeError from C++
            raise GrammarError(f"{kind}: {_clean(str(e))}") from None
        raise GrammarError(f"guided kind must be json_object, json_schema, regex or ebnf, got {kind!r}")

    def _compile_json_schema(self, spec: str) -> Any:
        """xgrammar 0.2 lets control characters into length-bounded strings (maxLength / minLength), which
        ``json.loads`` refuses; such grammars are recompiled from their EBNF text with the class JSON allows (or, if
        that fails, compiled as xgrammar made them)."""
        grammar = xgr.Grammar.from_json_schema(spec, any_whitespace=False, strict_mode=True)
        text = str(grammar)
        if _BOUNDED_STRING_CHAR in text:
            with contextlib.suppress(RuntimeError):
                return self.compiler.compile_grammar(text.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR))
        return self.compiler.compile_grammar(grammar)


def _check_schema_text(spec: str) -> None:
    """Name the two commonest mistakes in plain words before xgrammar's parser does in its own."""
    try:
        schema = json.loads(spec)
    except (TypeError, ValueError) as e:
        raise GrammarError(f"json_schema: the schema is not valid JSON ({e})") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"json_schema: the schema must be a JSON object, got {type(schema).__name__}")


def _clean(message: str) -> str:
    lines = [line for line in message.strip().splitlines() if line.strip()]
    first = _XGR_PREFIX.sub("", lines[0]) if lines else "invalid grammar"
    return first.strip() or "invalid grammar"


_compilers: weakref.WeakKeyDictionary[Any, dict[tuple[int, tuple[int, ...] | None], _Compiler]] = (
    weakref.WeakKeyDictionary()
)
_compilers_lock = threading.Lock()


def compile_grammar(
    tokenizer: Any, vocab_size: int, guided: GuidedDecoding, stop_token_ids: Sequence[int] | None = None
) -> CompiledGrammar:
    """Compile ``guided`` for ``tokenizer`` with a bitmask ``vocab_size`` wide (the model's logits width, which may
    exceed the tokenizer's vocabulary). Cached; raises GrammarError naming what is wrong.

    ``stop_token_ids`` (default: the tokenizer's EOS): the engine passes its own EOS set (generation_config may list
    several) so the mask allows exactly the tokens that stop it.
    """
    if not isinstance(vocab_size, int) or vocab_size <= 0:
        raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
    stops = tuple(sorted(set(stop_token_ids))) if stop_token_ids else None
    key = (vocab_size, stops)
    with _compilers_lock:
        per_tokenizer = _compilers.setdefault(tokenizer, {})
        compiler = per_tokenizer.get(key)
        if compiler is None:  # made under the lock: building TokenizerInfo twice for a big vocabulary costs seconds
            compiler = per_tokenizer[key] = _Compiler(tokenizer, vocab_size, list(stops) if stops else None)
    return compiler.get(guided)
