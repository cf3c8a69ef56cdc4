"""Public production traces, read and fitted to a cluster: what ``--dataset-name mooncake | azure | burstgpt |
trace-jsonl`` replays on a fixed schedule, and what ``pdserve plan --workload trace:FILE`` simulates.

``read_trace`` parses one format into ``TraceRow``s (trace time in seconds from the trace's first row, lengths in
tokens, and Mooncake's hash ids: one per ``block_tokens`` of the prompt, equal ids being equal blocks), naming the
file, line and field of a bad row. ``fit_trace`` applies ``TraceFit``: a window of trace time, at most ``max_rows``,
a token scale that multiplies lengths *and the hash-block size* (so two prompts share exactly the blocks they share
at full size), a speed-up that divides time, and the model's context (rows over it are counted, never cut). The
result's ``send_s`` is each row's time on the replay's clock, the first row of the window at 0. Nothing here needs a
tokenizer: ``workloads`` turns the rows into prompts.

Formats:
- ``mooncake``: JSONL ``{"timestamp": ms, "input_length": int, "output_length": int, "hash_ids": [int]}``, 512-token
  blocks (Mooncake's FAST '25 traces, Apache-2.0).
- ``azure``: CSV ``TIMESTAMP,ContextTokens,GeneratedTokens`` with wall-clock timestamps (the Azure LLM inference
  traces of Splitwise, ISCA '24; CC-BY-4.0); no prefix information.
- ``burstgpt``: CSV ``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type``, seconds (BurstGPT);
  rows with no response tokens (failed requests) are skipped and counted.
- ``trace-jsonl``: pdserve's own JSONL, ``{"arrival_s": s, "input_tokens": int, "output_tokens": int}`` with optional
  ``"hash_ids"`` and a ``"block_tokens"`` on the rows that carry them (what ``pdserve plan`` has always read).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path

TRACE_FORMATS = ("mooncake", "azure", "burstgpt", "trace-jsonl")
MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class TraceRow:
    line: int  # where it is in its file (1-based), for messages
    arrival_s: float  # trace time: seconds after the trace's first row (send time once fitted: ``send_s``)
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] | None = None  # one per ``block_tokens`` of the prompt; None: no prefix information


@dataclass(slots=True)
class RawTrace:
    name: str  # its format
    path: str
    rows: list[TraceRow]  # by arrival, the first at 0
    block_tokens: int | None  # the hash-block size (None: no hash ids)
    skipped: int = 0  # rows the format marks unusable (BurstGPT's failed requests: no response tokens)


@dataclass(frozen=True, slots=True)
class TraceFit:
    """How a trace is fitted to a cluster (``--trace-*`` options)."""

    speedup: float = 1.0  # trace time divided by this
    token_scale: float = 1.0  # lengths and the hash-block size multiplied by this
    window: tuple[float, float] | None = None  # [start, end) in trace seconds
    max_rows: int | None = None  # the first rows of the window only
    max_context_tokens: int | None = None  # a row's scaled prompt + output must fit (the model's context)

    def __post_init__(self) -> None:
        if not (self.speedup > 0 and math.isfinite(self.speedup)):
            raise ValueError(f"--trace-speedup must be a positive number, got {self.speedup!r}")
        if not (0 < self.token_scale <= 1024 and math.isfinite(self.token_scale)):
            raise ValueError(f"--trace-token-scale must be a positive number, got {self.token_scale!r}")
        if self.window is not None and not 0 <= self.window[0] < self.window[1]:
            raise ValueError(f"--trace-window must be START:END with 0 <= START < END, got {self.window!r}")
        if self.max_rows is not None and self.max_rows < 1:
            raise ValueError(f"--max-rows must be at least 1, got {self.max_rows!r}")


@dataclass(slots=True)
class Trace:
    """A fitted trace: the rows to send, each with its time on the replay's clock (``send_s``), and the counts a
    run reports (``rows``)."""

    name: str
    path: str
    fit: TraceFit
    rows: list[TraceRow]  # scaled lengths and hash ids; ``arrival_s`` is the send time
    block_tokens: int | None  # the scaled hash-block size
    counts: dict[str, int] = field(default_factory=dict)  # in_window, over_context, skipped

    @property
    def duration_s(self) -> float:
        return self.rows[-1].arrival_s if self.rows else 0.0

    def ideal_prefix_hit_rate(self) -> float | None:
        """The share of prompt tokens an unbounded prefix cache would hold, whole hash blocks from a prompt's start
        seen in an earlier row (a row's last, partial block counts as it is): None without hash ids."""
        if self.block_tokens is None:
            return None
        seen: set[tuple[int, ...]] = set()
        hit = total = 0
        for row in self.rows:
            total += row.input_tokens
            ids = row.hash_ids or ()
            for n in range(1, len(ids) + 1):
                prefix = ids[:n]
                if prefix not in seen:
                    break
                hit += min(self.block_tokens, row.input_tokens - (n - 1) * self.block_tokens)
            seen.update(ids[:n] for n in range(1, len(ids) + 1))
        return hit / total if total else 0.0


def parse_window(text: str) -> tuple[float, float]:
    """``START:END`` in seconds of trace time (``--trace-window``)."""
    try:
        start, end = (float(part) for part in text.split(":"))
    except ValueError:
        raise ValueError(f"--trace-window must be START:END in seconds, got {text!r}") from None
    return start, end


def read_trace(fmt: str, path: str | Path) -> RawTrace:
    if fmt not in TRACE_FORMATS:
        raise ValueError(f"a trace format is one of {', '.join(TRACE_FORMATS)}, got {fmt!r}")
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"--dataset-path: {str(path)!r} is not a file")
    reader = {"mooncake": _mooncake, "azure": _azure, "burstgpt": _burstgpt, "trace-jsonl": _trace_jsonl}[fmt]
    rows, block_tokens, skipped = reader(path)
    if not rows:
        raise ValueError(f"{path}: no request rows")
    rows.sort(key=lambda r: (r.arrival_s, r.line))
    start = rows[0].arrival_s
    rows = [replace(r, arrival_s=r.arrival_s - start) for r in rows]
    return RawTrace(fmt, str(path), rows, block_tokens, skipped)


def fit_trace(raw: RawTrace, fit: TraceFit) -> Trace:
    """The window's rows, at most ``max_rows``, scaled in length and time; those over the context are counted and
    left out (their places in the schedule stay empty)."""
    rows = raw.rows
    start = 0.0
    if fit.window is not None:
        start, end = fit.window
        rows = [r for r in rows if start <= r.arrival_s < end]
    if fit.max_rows is not None:
        rows = rows[: fit.max_rows]
    block = None if raw.block_tokens is None else max(1, round(raw.block_tokens * fit.token_scale))
    fitted, over = [], 0
    first = rows[0].arrival_s if rows else start
    for row in rows:
        scaled = _scaled(row, fit.token_scale, block)
        if fit.max_context_tokens is not None and scaled.input_tokens + scaled.output_tokens > fit.max_context_tokens:
            over += 1
            continue
        fitted.append(replace(scaled, arrival_s=(row.arrival_s - first) / fit.speedup))
    counts = {"in_window": len(rows), "over_context": over, "skipped": raw.skipped}
    return Trace(raw.name, raw.path, fit, fitted, block, counts)


def _scaled(row: TraceRow, scale: float, block: int | None) -> TraceRow:
    """Lengths times ``scale`` (at least 1); with hash ids, the prompt still spans exactly its blocks: more than all
    but the last, at most all."""
    input_tokens = max(1, round(row.input_tokens * scale))
    output_tokens = max(1, round(row.output_tokens * scale))
    if row.hash_ids is not None and block is not None:
        blocks = len(row.hash_ids)
        input_tokens = min(max(input_tokens, (blocks - 1) * block + 1), blocks * block)
    return replace(row, input_tokens=input_tokens, output_tokens=output_tokens)


# ---- the formats -------------------------------------------------------------------------------------------------


def _positive(path: Path, line: int, name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"{path}:{line}: {name} must be an integer >= {minimum}, got {value!r}")
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{path}:{line}: {name} must be an integer >= {minimum}, got {value!r}") from None
    if not number.is_integer() or number < minimum:
        raise ValueError(f"{path}:{line}: {name} must be an integer >= {minimum}, got {value!r}")
    return int(number)


def _seconds(path: Path, line: int, name: str, value: object, unit_s: float = 1.0) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"{path}:{line}: {name} must be a number, got {value!r}")
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{path}:{line}: {name} must be a number, got {value!r}") from None
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{path}:{line}: {name} must be a finite number >= 0, got {value!r}")
    return number * unit_s


def _json_lines(path: Path) -> Iterator[tuple[int, dict]]:
    with path.open() as file:
        for number, text in enumerate(file, 1):
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except ValueError as exc:
                raise ValueError(f"{path}:{number}: not a JSON object ({exc})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number}: not a JSON object")
            yield number, row


def _hash_ids(path: Path, line: int, value: object, input_tokens: int, block: int) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ValueError(f"{path}:{line}: hash_ids must be a list of integers, got {str(value)[:80]}")
    if len(value) != math.ceil(input_tokens / block):
        raise ValueError(
            f"{path}:{line}: hash_ids has {len(value)} ids, but {input_tokens} input tokens fill "
            f"{math.ceil(input_tokens / block)} blocks of {block}"
        )
    return tuple(value)


def _field(path: Path, line: int, row: dict, name: str) -> object:
    if name not in row:
        raise ValueError(f"{path}:{line}: {name} is missing")
    return row[name]


def _mooncake(path: Path) -> tuple[list[TraceRow], int | None, int]:
    rows = []
    for line, row in _json_lines(path):
        arrival = _seconds(path, line, "timestamp", _field(path, line, row, "timestamp"), 0.001)
        input_tokens = _positive(path, line, "input_length", _field(path, line, row, "input_length"))
        output_tokens = _positive(path, line, "output_length", _field(path, line, row, "output_length"))
        ids = _hash_ids(path, line, _field(path, line, row, "hash_ids"), input_tokens, MOONCAKE_BLOCK_TOKENS)
        rows.append(TraceRow(line, arrival, input_tokens, output_tokens, ids))
    return rows, MOONCAKE_BLOCK_TOKENS, 0


def _trace_jsonl(path: Path) -> tuple[list[TraceRow], int | None, int]:
    rows, block = [], None
    for line, row in _json_lines(path):
        arrival = _seconds(path, line, "arrival_s", _field(path, line, row, "arrival_s"))
        input_tokens = _positive(path, line, "input_tokens", _field(path, line, row, "input_tokens"))
        output_tokens = _positive(path, line, "output_tokens", _field(path, line, row, "output_tokens"))
        ids = None
        if "hash_ids" in row:
            size = _positive(path, line, "block_tokens", _field(path, line, row, "block_tokens"))
            if block is not None and size != block:
                raise ValueError(f"{path}:{line}: block_tokens {size} differs from the file's earlier {block}")
            block = size
            ids = _hash_ids(path, line, row["hash_ids"], input_tokens, size)
        rows.append(TraceRow(line, arrival, input_tokens, output_tokens, ids))
    if block is not None and any(r.hash_ids is None for r in rows):
        missing = next(r.line for r in rows if r.hash_ids is None)
        raise ValueError(f"{path}:{missing}: hash_ids is missing (other rows carry them: all or none)")
    return rows, block, 0


def _csv_rows(path: Path, columns: tuple[str, ...]) -> Iterator[tuple[int, dict[str, str]]]:
    with path.open(newline="") as file:
        reader = csv.DictReader(file)
        header = [name.strip() for name in reader.fieldnames or []]
        missing = [name for name in columns if name not in header]
        if missing:
            raise ValueError(f"{path}:1: the header lacks {', '.join(missing)} (has {', '.join(header)})")
        for row in reader:
            yield reader.line_num, {(k or "").strip(): (v or "").strip() for k, v in row.items()}


def _azure(path: Path) -> tuple[list[TraceRow], int | None, int]:
    rows = []
    for line, row in _csv_rows(path, ("TIMESTAMP", "ContextTokens", "GeneratedTokens")):
        text = row["TIMESTAMP"]
        try:  # seven digits of fraction (100 ns): fromisoformat takes at most six
            stamp = datetime.fromisoformat(text[:26] if "." in text else text)
        except ValueError:
            raise ValueError(f"{path}:{line}: TIMESTAMP must be a date and time, got {text!r}") from None
        input_tokens = _positive(path, line, "ContextTokens", row["ContextTokens"])
        output_tokens = _positive(path, line, "GeneratedTokens", row["GeneratedTokens"])
        rows.append(TraceRow(line, stamp.timestamp(), input_tokens, output_tokens))
    return rows, None, 0


def _burstgpt(path: Path) -> tuple[list[TraceRow], int | None, int]:
    rows, skipped = [], 0
    for line, row in _csv_rows(path, ("Timestamp", "Request tokens", "Response tokens")):
        arrival = _seconds(path, line, "Timestamp", row["Timestamp"])
        input_tokens = _positive(path, line, "Request tokens", row["Request tokens"])
        output_tokens = _positive(path, line, "Response tokens", row["Response tokens"], minimum=0)
        if output_tokens == 0:  # a failed request: nothing to replay
            skipped += 1
            continue
        rows.append(TraceRow(line, arrival, input_tokens, output_tokens))
    return rows, None, skipped
