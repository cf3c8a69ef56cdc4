"""`make gpu-wheels`: the wheels `make gpu-check` needs that the GPU machine's image lacks, fetched where pip works.

    python3 checks/gpu/gpu_wheels.py --dest .whl               # pyzmq and msgspec (the KV plane's sockets, headers)
    python3 checks/gpu/gpu_wheels.py --dest .whl --flashinfer  # and FlashInfer 0.6 with its prebuilt kernels

Each wheel is ``pip download --no-deps`` with the image's platform tags (CPython 3.12, manylinux x86_64), so the
image's pip resolves nothing; FlashInfer's dependencies come from its wheels' metadata, less ``IMAGE_PROVIDES``. Its
prebuilt kernels (``flashinfer-cubin``, and ``flashinfer-jit-cache`` when its index answers) spare minutes of
compiling on first use; without them the quick check skips it. What cannot be fetched is printed, not fatal.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

try:
    from packaging.requirements import Requirement
except ImportError:  # a bare interpreter: pip carries its own copy
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]

PYTHON_VERSION = "3.12"
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
TARGET_MARKERS = {
    "python_version": PYTHON_VERSION,
    "python_full_version": f"{PYTHON_VERSION}.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "extra": "",
}
BASE_WHEELS = ["pyzmq==27.3.0", "msgspec==0.22.0"]  # the KV plane's sockets and its typed headers
FLASHINFER_VERSION = "0.6.13"  # the newest release with a matching flashinfer-cubin on PyPI
# cu13: the image's CUDA (FlashInfer's extra picks the CUTLASS DSL libraries built for it)
FLASHINFER_WHEELS = [f"flashinfer-python[cu13]=={FLASHINFER_VERSION}", f"flashinfer-cubin=={FLASHINFER_VERSION}"]
JIT_CACHE = (f"flashinfer-jit-cache=={FLASHINFER_VERSION}", "https://flashinfer.ai/whl/cu130")
# what the GPU image has (torch 2.11 cu130 with its dependencies, transformers 5 with its own, the check's packages)
IMAGE_PROVIDES = {
    "torch", "triton", "numpy", "transformers", "accelerate", "tokenizers", "safetensors", "huggingface-hub",
    "msgpack", "xxhash", "pyyaml", "prometheus-client", "uvloop", "httpx", "filelock", "typing-extensions", "sympy",
    "networkx", "jinja2", "fsspec", "setuptools", "packaging", "regex", "tqdm", "requests", "psutil", "mpmath",
    "markupsafe", "certifi", "idna", "urllib3", "charset-normalizer", "httpcore", "anyio", "h11", "sniffio",
}  # fmt: skip
IMAGE_PROVIDES_PREFIXES = ("nvidia-cublas", "nvidia-cuda-", "nvidia-cudnn-cu", "nvidia-cufft", "nvidia-curand",
                           "nvidia-cusolver", "nvidia-cusparse", "nvidia-nccl", "nvidia-nvjitlink", "nvidia-nvtx",
                           "nvidia-cufile", "nvidia-nvshmem")  # fmt: skip
CARRY_LIMIT_BYTES = 64 * 1024 * 1024  # what a tree sent to this workplace's GPU machines may carry in all


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def in_image(name: str) -> bool:
    name = normalize(name)
    return name in IMAGE_PROVIDES or name.startswith(IMAGE_PROVIDES_PREFIXES)


def requirements_of(wheel: Path, extras: set[str] | frozenset[str] = frozenset()) -> list[Requirement]:
    """A wheel's Requires-Dist that apply on the target with ``extras`` asked for (others' extras left out)."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(name).decode().splitlines()
    out = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            requirement = Requirement(line.split(":", 1)[1].strip())
            marker = requirement.marker
            if marker is None or any(marker.evaluate({**TARGET_MARKERS, "extra": e}) for e in {"", *extras}):
                out.append(requirement)
    return out


def resolve(roots: list[str], download: Callable[[str], Path | None]) -> tuple[list[Path], list[str]]:
    """Download ``roots`` and every dependency the image lacks (breadth first, each name once, extras asked for anywhere
    counted); ``download(requirement)`` returns the wheel or None. Returns the wheels and what could not be had."""
    wheels: dict[str, Path] = {}
    extras: dict[str, set[str]] = {}
    failed: list[str] = []
    queue = [Requirement(spec) for spec in roots]
    while queue:
        requirement = queue.pop(0)
        name = normalize(requirement.name)
        known = extras.get(name)
        if known is not None and requirement.extras <= known:
            continue
        if known is None:
            wheel = download(f"{requirement.name}{requirement.specifier}")
            extras[name] = set()
            if wheel is None:
                failed.append(str(requirement))
                continue
            wheels[name] = wheel
        elif name not in wheels:
            continue  # could not be fetched before
        extras[name] |= requirement.extras
        for dependency in requirements_of(wheels[name], extras[name]):
            if not in_image(dependency.name):
                queue.append(dependency)
    return list(wheels.values()), failed


def pip_download(dest: Path, index: str | None = None) -> Callable[[str], Path | None]:
    def download(spec: str) -> Path | None:
        before = set(dest.glob("*.whl"))
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest)]
        command += ["--python-version", PYTHON_VERSION, "--implementation", "cp"]
        for platform in PLATFORMS:
            command += ["--platform", platform]
        if index:
            command += ["--extra-index-url", index]
        done = subprocess.run([*command, spec], capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            print(f"gpu-wheels: could not fetch {spec}: {done.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            return None
        new = set(dest.glob("*.whl")) - before
        prefix = normalize(Requirement(spec).name) + "-"  # already there from an earlier run: pip saves nothing new
        return next(iter(new), None) or next(
            (w for w in dest.glob("*.whl") if normalize(w.name).startswith(prefix)), None
        )

    return download


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", default=".whl", type=Path)
    ap.add_argument("--flashinfer", action="store_true", help="FlashInfer 0.6, its prebuilt kernels and its deps")
    args = ap.parse_args(argv)
    args.dest.mkdir(parents=True, exist_ok=True)
    roots = BASE_WHEELS + (FLASHINFER_WHEELS if args.flashinfer else [])
    wheels, failed = resolve(roots, pip_download(args.dest))
    if args.flashinfer:
        spec, index = JIT_CACHE
        jit = pip_download(args.dest, index)(spec)
        (wheels.append(jit) if jit is not None else failed.append(f"{spec} (from {index})"))
    total = sum(w.stat().st_size for w in wheels)
    print(f"gpu-wheels: {len(wheels)} wheels, {total / 2**20:.1f} MiB in {args.dest}")
    if failed:
        print(f"gpu-wheels: not fetched: {', '.join(failed)}")
    if total > CARRY_LIMIT_BYTES:
        print(f"gpu-wheels: more than {CARRY_LIMIT_BYTES >> 20} MiB: too large to carry with the tree to a GPU machine "
              "lent by this workplace; copy .whl there another way")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
