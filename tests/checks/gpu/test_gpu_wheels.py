"""`make gpu-wheels`'s resolution: each root, then each dependency its wheel's metadata names that the GPU image lacks,
for the image's Python and platform, extras followed. The download is faked (wheels built here with the metadata a
real one carries); the metadata reading, the marker evaluation and the image's exclusions are the real code."""

from __future__ import annotations

import zipfile
from pathlib import Path

from checks.gpu.gpu_wheels import FLASHINFER_WHEELS, in_image, resolve


def _wheel(folder: Path, name: str, version: str, requires: list[str]) -> Path:
    path = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    metadata = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    metadata += [f"Requires-Dist: {r}" for r in requires]
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name.replace('-', '_')}-{version}.dist-info/METADATA", "\n".join(metadata) + "\n")
    return path


def test_dependencies_the_image_lacks_are_fetched_once_and_for_the_target(tmp_path):
    index = {
        "flashinfer-python": _wheel(tmp_path, "flashinfer-python", "0.6.13", [
            "torch", "numpy", "einops", "apache-tvm-ffi<0.2,>=0.1.6", "nvidia-cutlass-dsl>=4.5.0",
            "nvidia-cublas-cu13", "pywin32; sys_platform == 'win32'", "old-backport; python_version < '3.10'",
            "nvidia-cutlass-dsl[cu13]>=4.5.0; extra == 'cu13'", "cuda-python>=13.0; extra == 'nvep'",
        ]),
        "einops": _wheel(tmp_path, "einops", "0.8.2", []),
        "apache-tvm-ffi": _wheel(tmp_path, "apache-tvm-ffi", "0.1.15", ["typing-extensions"]),
        "nvidia-cutlass-dsl": _wheel(tmp_path, "nvidia-cutlass-dsl", "4.8.1", [
            "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-cu13; extra == 'cu13'",
        ]),
        "nvidia-cutlass-dsl-libs-base": _wheel(tmp_path, "nvidia-cutlass-dsl-libs-base", "4.8.1", []),
        "nvidia-cutlass-dsl-libs-cu13": _wheel(tmp_path, "nvidia-cutlass-dsl-libs-cu13", "4.8.1", []),
        "flashinfer-cubin": _wheel(tmp_path, "flashinfer-cubin", "0.6.13", []),
        "pyzmq": _wheel(tmp_path, "pyzmq", "27.3.0", []),
    }  # fmt: skip
    asked: list[str] = []

    def download(spec: str) -> Path | None:
        asked.append(spec)
        name = spec.split("=")[0].split("<")[0].split(">")[0]
        return index.get(name)

    wheels, failed = resolve(["pyzmq==27.3.0", *FLASHINFER_WHEELS], download)
    names = sorted(w.name.split("-")[0] for w in wheels)
    assert names == sorted(
        n.replace("-", "_")
        for n in (
            "pyzmq", "flashinfer-python", "flashinfer-cubin", "einops", "apache-tvm-ffi", "nvidia-cutlass-dsl",
            "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-cu13",
        )
    )  # fmt: skip
    assert failed == []
    # torch, numpy, CUDA runtime libraries and typing-extensions are the image's; Windows and old-Python ones never
    for name in ("torch", "numpy", "nvidia-cublas-cu13", "typing-extensions", "pywin32", "old-backport", "cuda-python"):
        assert not any(a.startswith(name) for a in asked), name
    assert len(asked) == len(set(asked))  # each wheel fetched once, however many times it is named
    assert "apache-tvm-ffi<0.2,>=0.1.6" in asked or "apache-tvm-ffi>=0.1.6,<0.2" in asked


def test_a_wheel_that_cannot_be_had_is_reported_not_fatal(tmp_path):
    wheels, failed = resolve(["pyzmq==27.3.0", "flashinfer-jit-cache==0.6.13"], lambda spec: None)
    assert wheels == [] and failed == ["pyzmq==27.3.0", "flashinfer-jit-cache==0.6.13"]


def test_the_image_provides_torch_and_its_cuda_libraries():
    assert in_image("torch") and in_image("nvidia-nccl-cu13") and in_image("Typing_Extensions")
    assert not in_image("pyzmq") and not in_image("nvidia-cudnn-frontend") and not in_image("flashinfer-python")
