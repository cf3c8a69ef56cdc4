"""What CPU this is, for every CPU figure a benchmark prints and for the compiled decode step's cache key.

Read from ``/proc/cpuinfo`` (Linux) with ``platform`` as the fallback; no torch import, so the load tester and the
benchmarks that import nothing of the engine can name the CPU too.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
from pathlib import Path

# the flags a CPU figure is read against: bf16 and int8 matrix units, and the vector widths inductor compiles for
NOTED_FLAGS = ("amx_bf16", "amx_int8", "amx_tile", "avx512_bf16", "avx512_vnni", "avx512f", "avx2")


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        name, sep, value = line.partition(":")
        if sep:
            fields[name.strip()] = value.strip()
    return fields


def cpu_flags() -> frozenset[str]:
    info = _cpuinfo()
    return frozenset((info.get("flags") or info.get("Features") or "").split())


def has_bf16_matmul() -> bool:
    """AMX or AVX-512 BF16: the CPU multiplies bfloat16 in hardware (oneDNN's bf16 kernels use it)."""
    return bool(cpu_flags() & {"amx_bf16", "avx512_bf16"})


def cpu_model() -> str:
    """``model name`` (vendor, family and model numbers where the name is generic), the noted flags it has, and the
    cores: what every CPU figure is printed beside. E.g. ``AMD EPYC (family 25, model 17); avx512_bf16 avx512f; 2
    cores``."""
    info = _cpuinfo()
    name = info.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    if "family" not in name.lower() and info.get("cpu family"):
        name += f" (family {info['cpu family']}, model {info.get('model', '?')})"
    flags = [flag for flag in NOTED_FLAGS if flag in cpu_flags()]
    return f"{name}; {' '.join(flags) or 'no avx2'}; {os.cpu_count()} cores"


def cpu_fingerprint() -> str:
    """Changes when code compiled for this CPU may not run, or not as fast, on another: model and every flag."""
    info = _cpuinfo()
    text = "|".join([info.get("vendor_id", ""), info.get("model name", ""), info.get("cpu family", "")])
    text += "|" + info.get("model", "") + "|" + " ".join(sorted(cpu_flags())) + "|" + platform.machine()
    return hashlib.sha256(text.encode()).hexdigest()[:16]
