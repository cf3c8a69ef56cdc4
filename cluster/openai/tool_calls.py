"""Generated text -> OpenAI ``tool_calls``, whole (``parse_output``) or as streamed deltas (``ToolCallStreamParser``).

By tool mode: ``named``, the whole text is the function's arguments; ``required``, one call per item of a JSON
array; ``auto``, Hermes ``<tool_call>{"name": .., "arguments": {..}}</tool_call>`` blocks are calls and the rest is
content (None if only whitespace; a block that is not a call stays in it). ``parse_output`` runs the one streaming
parser over the whole text, so both answers agree by construction. Deltas have vLLM's shape: per call a head with
``index``, ``id`` and ``name`` once the name is known, then argument fragments: the model's own text, held back
only where it may be the call's closing brace, so nothing is ever taken back.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cluster.openai.guided import GuidedPlan, ToolMode

START, END = "<tool_call>", "</tool_call>"
# a call's head: its name and "arguments" (Hermes) or "parameters" (required mode, some models); only accepted
# when a non-space character follows, so the match cannot grow later
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(slots=True)
class ParsedOutput:
    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def parse_output(plan: GuidedPlan, text: str, id_factory: Callable[[], str] = new_tool_call_id) -> ParsedOutput:
    if not plan.calls_tools:
        return ParsedOutput(text)
    parser = ToolCallStreamParser(plan, id_factory)
    return join_deltas(parser.feed(text) + parser.finish())


def join_deltas(deltas: list[dict[str, Any]]) -> ParsedOutput:
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        if "content" in delta:
            content.append(delta["content"])
        for item in delta.get("tool_calls", ()):
            call = calls.get(item["index"])
            if call is None:
                call = calls[item["index"]] = {
                    "id": item["id"],
                    "type": "function",
                    "function": {"name": item["function"]["name"], "arguments": ""},
                }
            call["function"]["arguments"] += item["function"].get("arguments", "")
    text = "".join(content)
    return ParsedOutput(text or None, [calls[i] for i in sorted(calls)])


class ToolCallStreamParser:
    """Fed the text delta by delta, returns the chat deltas to send; ``finish`` flushes the rest."""

    def __init__(self, plan: GuidedPlan, id_factory: Callable[[], str] = new_tool_call_id) -> None:
        self.plan = plan
        self._new_id = id_factory
        self._out: list[dict[str, Any]] = []
        self.num_calls = 0
        # auto: text not yet placed (a possible partial <tool_call>, or the current block's text)
        self._buf = ""
        self._inside = False
        self._scan_from = 0  # where to look for END in the block (it cannot start earlier)
        self._pending_ws = ""  # auto content that is only whitespace so far: sent once real content follows
        self._content_live = False
        # required: a JSON scanner over the array, and the current item's text
        self._depth = 0
        self._in_string = False
        self._escape = False
        # the current block / item's call: None until its head is known
        self._call: _Call | None = None
        self._args_start = 0  # where its arguments start in the block / item text

    def feed(self, delta: str) -> list[dict[str, Any]]:
        mode = self.plan.tool_mode
        if mode == ToolMode.NONE:
            if delta:
                self._out.append({"content": delta})
        elif mode == ToolMode.NAMED:  # the whole text is the arguments: sent as it comes
            self._named_head()
            self._buf += delta
            self._args(self._buf)
        elif mode == ToolMode.REQUIRED:
            self._feed_required(delta)
        else:
            self._feed_auto(delta)
        out, self._out = self._out, []
        return out

    def finish(self) -> list[dict[str, Any]]:
        mode = self.plan.tool_mode
        if mode == ToolMode.NAMED:
            self._named_head()
        elif mode == ToolMode.REQUIRED and self._depth >= 2:
            self._close(self._buf, is_block=False)
        elif mode == ToolMode.AUTO:
            if self._inside:
                self._close(self._buf, is_block=True, closed=False)
            else:
                self._content(self._buf)
        self._buf = ""
        out, self._out = self._out, []
        return out

    # ---- named -----------------------------------------------------------------------------------------------------
    def _named_head(self) -> None:
        if self._call is None:
            self._start_call(self.plan.function_name or "")

    # ---- required: items of a JSON array ---------------------------------------------------------------------------
    def _feed_required(self, delta: str) -> None:
        for ch in delta:
            if self._depth >= 2:
                self._buf += ch
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "[{":
                self._depth += 1
                if self._depth == 2:  # an item starts
                    self._buf = ch
            elif ch in "]}":
                self._depth -= 1
                if self._depth == 1:  # the item is complete
                    self._close(self._buf, is_block=False)
                    self._buf = ""
        if self._depth >= 2:
            self._progress(self._buf)

    # ---- auto: Hermes blocks in free text --------------------------------------------------------------------------
    def _feed_auto(self, delta: str) -> None:
        text = self._buf + delta
        while True:
            if not self._inside:
                i = text.find(START)
                if i < 0:
                    keep = _partial_suffix(text, START)
                    self._content(text[: len(text) - keep])
                    self._buf = text[len(text) - keep :]
                    return
                self._content(text[:i])
                text, self._inside, self._scan_from = text[i + len(START) :], True, 0
                continue
            j = text.find(END, self._scan_from)
            if j < 0:
                self._buf = text
                self._scan_from = max(0, len(text) - len(END) + 1)
                self._progress(text[: len(text) - _partial_suffix(text, END)])
                return
            self._close(text[:j], is_block=True, closed=True)
            text, self._inside = text[j + len(END) :], False

    def _content(self, text: str) -> None:
        if not text:
            return
        if not self._content_live:
            self._pending_ws += text
            if not self._pending_ws.strip():
                return
            text, self._pending_ws, self._content_live = self._pending_ws, "", True
        self._out.append({"content": text})

    # ---- one call's head and arguments -----------------------------------------------------------------------------
    def _known_call(self, text: str) -> bool:
        """Whether the block / item has a call: started here once its head is complete."""
        if self._call is None and (head := _head(text)) is not None:
            name, self._args_start = head
            self._start_call(name)
        return self._call is not None

    def _progress(self, text: str) -> None:
        """The block / item so far: send its head once known, then the argument text that is surely final."""
        if self._known_call(text):
            self._args(_args_so_far(text[self._args_start :]))

    def _close(self, text: str, is_block: bool, closed: bool = True) -> None:
        """A block (auto) or item (required) ended: finish its call, or decide it is not one."""
        if self._known_call(text):
            self._args(_args_so_far(text[self._args_start :]))
        else:
            fallback = _json_call(text)
            if fallback is not None:
                self._start_call(fallback[0])
                self._args(fallback[1])
            elif is_block:  # not a call: the block stays in the content, as the model wrote it
                self._content(START + text + (END if closed else ""))
        self._call = None

    def _start_call(self, name: str) -> None:
        if not self.plan.parallel_tool_calls and self.num_calls >= 1:
            self._call = _Call(-1)  # one call at most: the rest are dropped
            return
        self._call = _Call(self.num_calls)
        self.num_calls += 1
        head = {"index": self._call.index, "id": self._new_id(), "type": "function"}
        self._out.append({"tool_calls": [{**head, "function": {"name": name, "arguments": ""}}]})

    def _args(self, args_text: str) -> None:
        """Send what ``args_text`` (the argument text so far) adds to what was sent."""
        call = self._call
        if call is None or call.index < 0 or len(args_text) <= call.sent:
            return
        fragment, call.sent = args_text[call.sent :], len(args_text)
        self._out.append({"tool_calls": [{"index": call.index, "function": {"arguments": fragment}}]})


@dataclass(slots=True)
class _Call:
    index: int  # -1: dropped (parallel_tool_calls false and a call was already made)
    sent: int = 0  # characters of argument text already sent


def _head(text: str) -> tuple[str, int] | None:
    """(name, where the arguments start) once the head is complete and something follows it."""
    match = _HEAD.match(text)
    if match is None or match.end() >= len(text):
        return None
    try:
        name = json.loads(f'"{match.group(1)}"')
    except ValueError:
        return None
    return name, match.end()


def _args_so_far(text: str) -> str:
    """The argument text that cannot change: all but trailing spaces and one '}' (maybe the call's close)."""
    end = len(text.rstrip())
    if end and text[end - 1] == "}":
        end = len(text[: end - 1].rstrip())
    return text[:end]


def _json_call(text: str) -> tuple[str, str] | None:
    """A block whose head did not match (keys in another order...) but that is a JSON call."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", value.get("parameters", {}))
    return value["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that starts ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def tool_finish_reason(engine_reason: str, called: bool) -> str:
    """``tool_calls`` when the model ended by calling; a cut text ("length") keeps its reason, so a client knows the
    arguments may be incomplete JSON."""
    return "tool_calls" if called and engine_reason == "stop" else engine_reason
