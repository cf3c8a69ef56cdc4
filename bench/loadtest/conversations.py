"""Multi-turn chat workload (``--dataset-name multi-turn``): the conversations a run plays, built before timing.

A conversation is its user turns, each answer's ``max_tokens`` and the think times after each answer. Every turn
sends the whole history with the server's *actual* answers (``ConversationSpec.messages``), so turn k's prompt is
turn k-1's plus the server's own tokens and one more user turn: a test of prefix reuse. Synthetic user messages are
exactly ``--random-input-len`` tokens on their own (no template, no history); a ShareGPT-style file (JSON list or
JSONL, ``conversations`` or ``messages``) gives its human turns in order, each output length the following gpt
turn's token count (drawn when absent), shuffled with ``--seed`` and cycled. Think times are drawn in advance, so a
seed replays the same schedule.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.loadtest.options import THINK_TIME_DISTS
from bench.loadtest.workloads import PromptBuilder, WorkloadSettings, draw_lengths

DEFAULT_TURNS = 3
_HUMAN = ("human", "user")
_ASSISTANT = ("gpt", "assistant", "chatgpt", "bard", "model")


@dataclass(slots=True)
class ConversationSettings:
    num_conversations: int = 16  # per rate; 0: only the duration bounds the run
    num_turns: int | None = None  # None: DEFAULT_TURNS, or the file's
    num_turns_range_ratio: float = 0.0
    think_time_s: float = 0.0
    think_time_dist: str = "fixed"

    def validate(self) -> None:
        if self.num_conversations < 0:
            raise ValueError("--num-conversations cannot be negative")
        if self.num_turns is not None and self.num_turns < 1:
            raise ValueError("--num-turns must be at least 1")
        if not 0 <= self.num_turns_range_ratio < 1:
            raise ValueError("--num-turns-range-ratio must be within [0, 1)")
        if self.think_time_s < 0:
            raise ValueError("--think-time-s cannot be negative")
        if self.think_time_dist not in THINK_TIME_DISTS:
            raise ValueError(f"--think-time-dist: {self.think_time_dist!r} is not one of {', '.join(THINK_TIME_DISTS)}")


@dataclass(slots=True)
class ConversationSpec:
    """One conversation's user side: turn k (from 0) sends ``user_turns[k]`` after the history, asks for
    ``output_tokens[k]`` tokens, and (k > 0) is sent ``think_s[k - 1]`` seconds after turn k-1's answer ended."""

    index: int
    user_turns: list[str]
    user_tokens: list[int]  # each user message's own token count (no template)
    output_tokens: list[int]
    think_s: list[float] = field(default_factory=list)
    system: str | None = None

    @property
    def turns(self) -> int:
        return len(self.user_turns)

    def messages(self, answers: list[str]) -> list[dict]:
        """The request of turn ``len(answers)`` (from 0): each earlier user turn and its answer, then the next turn."""
        k = len(answers)
        if k >= self.turns:
            raise ValueError(f"conversation {self.index} has {self.turns} turns; turn {k + 1} does not exist")
        out = [{"role": "system", "content": self.system}] if self.system is not None else []
        for user, answer in zip(self.user_turns, answers):
            out += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        out.append({"role": "user", "content": self.user_turns[k]})
        return out


def count_chat(tokenizer, messages: list[dict]) -> int:
    """Prompt tokens of a templated conversation, as an OpenAI-compatible server counts them."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return len(ids)


def draw_think_times(mean_s: float, n: int, dist: str, rng: np.random.Generator) -> list[float]:
    if mean_s <= 0 or n <= 0:
        return [0.0] * max(n, 0)
    if dist == "exponential":
        return [float(x) for x in rng.exponential(mean_s, size=n)]
    return [float(mean_s)] * n


def build_conversations(
    settings: ConversationSettings, workload: WorkloadSettings, builder: PromptBuilder, n: int
) -> list[ConversationSpec]:
    settings.validate()
    if n < 1:
        raise ValueError("a run needs at least one conversation")
    if not builder.chat:
        raise ValueError("--dataset-name multi-turn sends chat conversations: use --endpoint-type chat")
    rng = np.random.default_rng(workload.seed)
    if workload.dataset_path:
        return _from_file(settings, workload, builder, n, rng)
    turns = draw_lengths(
        settings.num_turns or DEFAULT_TURNS,
        n,
        "uniform" if settings.num_turns_range_ratio else "fixed",
        rng,
        settings.num_turns_range_ratio,
    )
    total = sum(turns)
    users = draw_lengths(
        workload.random_input_len, total, workload.dist, rng, workload.random_range_ratio, workload.length_cv
    )
    outputs = draw_lengths(
        workload.random_output_len, total, workload.dist, rng, workload.random_range_ratio, workload.length_cv
    )
    specs, at = [], 0
    for i, t in enumerate(turns):
        lengths = users[at : at + t]
        specs.append(
            ConversationSpec(
                i,
                [builder.build_system(length) for length in lengths],
                lengths,
                outputs[at : at + t],
                draw_think_times(settings.think_time_s, t - 1, settings.think_time_dist, rng),
            )
        )
        at += t
    return specs


def _from_file(
    settings: ConversationSettings, workload: WorkloadSettings, builder: PromptBuilder, n: int, rng: np.random.Generator
) -> list[ConversationSpec]:
    path = Path(workload.dataset_path or "").expanduser()
    if not path.is_file():
        raise ValueError(f"--dataset-path: {str(path)!r} is not a file")
    rows = read_conversation_file(path)
    tok = builder.tokenizer
    found: list[tuple[list[str], list[int]]] = []
    for turns in rows:
        if settings.num_turns:
            turns = turns[: settings.num_turns]
        if turns:
            users = [user for user, _ in turns]
            outputs = [
                (len(tok(answer, add_special_tokens=False)["input_ids"]) if answer else 0) for _, answer in turns
            ]
            found.append((users, outputs))
    if not found:
        raise ValueError(f"--dataset-path: {str(path)!r} holds no conversation with a human turn")
    order = rng.permutation(len(found)).tolist()
    specs = []
    for i in range(n):
        users, outputs = found[order[i % len(found)]]
        drawn = draw_lengths(
            workload.random_output_len, len(users), workload.dist, rng, workload.random_range_ratio, workload.length_cv
        )
        specs.append(
            ConversationSpec(
                i,
                list(users),
                [len(tok(u, add_special_tokens=False)["input_ids"]) for u in users],
                [o if o else d for o, d in zip(outputs, drawn)],
                draw_think_times(settings.think_time_s, len(users) - 1, settings.think_time_dist, rng),
            )
        )
    return specs


def read_conversation_file(path: Path) -> list[list[tuple[str, str | None]]]:
    """Each conversation as ``[(human text, the reply or None), ...]``; other roles (system, tool) are ignored."""
    text = path.read_text()
    try:
        data = json.loads(text)
    except ValueError:
        try:
            data = [json.loads(line) for line in text.splitlines() if line.strip()]
        except ValueError as exc:
            raise ValueError(f"{path}: neither a JSON list nor JSON lines ({exc})") from None
    if not isinstance(data, list):
        raise ValueError(f'{path}: a ShareGPT-style file is a JSON list of {{"conversations": [...]}}')
    out = []
    for row in data:
        if not isinstance(row, dict):
            continue
        turns = row.get("conversations") or row.get("conversation") or row.get("messages") or []
        if not isinstance(turns, list):
            continue
        pairs: list[tuple[str, str | None]] = []
        for turn in turns:
            if not isinstance(turn, dict):
                continue
            role = turn.get("from", turn.get("role"))
            value = turn.get("value", turn.get("content"))
            if not isinstance(value, str) or not value:
                continue
            if role in _HUMAN:
                pairs.append((value, None))
            elif role in _ASSISTANT and pairs and pairs[-1][1] is None:
                pairs[-1] = (pairs[-1][0], value)
        out.append(pairs)
    return out
