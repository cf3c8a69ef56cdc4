"""The verdict of a ``make cluster-e2e`` summary: ``ok`` only when every part of it is.

Each check in the summary carries its own figures; what makes a part fail is written here once: an ``ok`` flag that
is false anywhere in it, greedy tokens unequal to transformers', and per fault a request lost (sent, neither completed
nor failed), KV or requests still held afterwards, or a load generator that did not exit cleanly. A step that raised
is a failed part too (``error``).
"""

from __future__ import annotations

from typing import Any


def failed_parts(summary: dict[str, Any]) -> list[str]:
    """The paths of the parts that failed, in the summary's order (empty: all passed)."""
    failed: list[str] = []
    if summary.get("error"):
        failed.append("error")

    def walk(value: Any, path: str) -> None:
        if isinstance(value, dict):
            if value.get("ok") is False:
                failed.append(f"{path}.ok" if path else "ok")
            for key, inner in value.items():
                if key != "ok":
                    walk(inner, f"{path}.{key}" if path else key)

    walk({k: v for k, v in summary.items() if k not in ("ok", "failed_parts")}, "")
    greedy = summary.get("openai_client", {}).get("greedy_vs_transformers") or summary.get("greedy_vs_transformers")
    if isinstance(greedy, dict) and greedy.get("equal") is False:
        failed.append("greedy_vs_transformers.equal")
    for name, fault in (summary.get("faults") or {}).items():
        if not isinstance(fault, dict) or "skipped" in fault:
            continue
        if fault.get("lost"):
            failed.append(f"faults.{name}.lost")
        if any(fault.get("kv_held_after", {}).values()):
            failed.append(f"faults.{name}.kv_held_after")
        if fault.get("bench_exit") not in (0, None):
            failed.append(f"faults.{name}.bench_exit")
    return failed
