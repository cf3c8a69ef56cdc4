"""CUDA IPC memory handles through the driver API (libcuda), for the direct path on a GPU (transfer/kv_segment.py;
why not torch's tensor sharing: docs/transfer.md, "Same-node direct writes").

export   (receiver) a tensor's allocation base -> cuIpcGetMemHandle -> [handle (64 bytes), offset, nbytes]
open     (sender) cuIpcOpenMemHandle once per distinct handle, on the local index of the receiver's GPU (by UUID) -> a
         uint8 tensor over [base + offset, + nbytes), through __cuda_array_interface__ (no copy)
An allocation made with expandable segments (cuMemCreate) has no IPC handle: export raises, and the receiver offers
no direct path.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

HANDLE_BYTES = 64
LAZY_ENABLE_PEER_ACCESS = 1


class CudaIpcError(RuntimeError):
    pass


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * HANDLE_BYTES)]


@functools.cache
def _driver() -> Any:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise CudaIpcError(f"no CUDA driver library: {e}") from None
    ptr, size = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t)
    lib.cuMemGetAddressRange_v2.argtypes = [ptr, size, ctypes.c_uint64]
    lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_Handle), ctypes.c_uint64]
    lib.cuIpcOpenMemHandle_v2.argtypes = [ptr, _Handle, ctypes.c_uint]
    lib.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]
    lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return lib


def _check(result: int, what: str) -> None:
    if result != 0:
        msg = ctypes.c_char_p()
        _driver().cuGetErrorString(result, ctypes.byref(msg))
        raise CudaIpcError(f"{what}: CUDA error {result} ({(msg.value or b'?').decode()})")


def visible_gpus() -> list[str]:
    """UUIDs of the GPUs this process can open memory on, in its own index order (what the hello offers)."""
    if not torch.cuda.is_available():
        return []
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


def export(t: torch.Tensor) -> list[Any]:
    """[handle, offset, nbytes] of a contiguous CUDA tensor's bytes within its allocation."""
    if not t.is_cuda or not t.is_contiguous():
        raise CudaIpcError("only a contiguous CUDA tensor has an IPC handle here")
    torch.cuda.set_device(t.device)  # the driver calls below run in the device's primary context
    lib, ptr = _driver(), ctypes.c_uint64(t.data_ptr())
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    _check(lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr), "cuMemGetAddressRange")
    handle = _Handle()
    _check(lib.cuIpcGetMemHandle(ctypes.byref(handle), base), "cuIpcGetMemHandle")
    return [bytes(handle.reserved), ptr.value - base.value, t.numel() * t.element_size()]


class _CudaArray:
    """The minimal __cuda_array_interface__ torch.as_tensor reads: bytes at a device pointer."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }


class OpenedMemory:
    """A sender's view of another process's allocations: each distinct handle opened once, closed at `close`."""

    def __init__(self, gpu_uuid: str) -> None:
        gpus = visible_gpus()
        if gpu_uuid not in gpus:
            raise CudaIpcError(f"GPU {gpu_uuid} is not visible to this process (CUDA_VISIBLE_DEVICES)")
        self.device = torch.device("cuda", gpus.index(gpu_uuid))
        self._bases: dict[bytes, int] = {}

    def tensor(self, exported: list[Any]) -> torch.Tensor:
        """A uint8 tensor over what `export` described (checked: a 64-byte handle, non-negative ints)."""
        handle, offset, nbytes = exported
        if not isinstance(handle, bytes) or len(handle) != HANDLE_BYTES:
            raise CudaIpcError("malformed CUDA IPC handle")
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (offset, nbytes)):
            raise CudaIpcError("malformed CUDA IPC offset or size")
        base = self._bases.get(handle)
        if base is None:
            torch.cuda.set_device(self.device)
            ptr = ctypes.c_uint64()
            raw = _Handle.from_buffer_copy(handle)
            _check(
                _driver().cuIpcOpenMemHandle_v2(ctypes.byref(ptr), raw, LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle"
            )
            base = self._bases[handle] = ptr.value
        return torch.as_tensor(_CudaArray(base + offset, nbytes), device=self.device)

    def close(self) -> None:
        """Unmap every opened allocation (the caller has dropped its tensors over them)."""
        torch.cuda.set_device(self.device)
        for base in self._bases.values():
            _driver().cuIpcCloseMemHandle(ctypes.c_uint64(base))
        self._bases.clear()
