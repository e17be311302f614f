"""Helpers of ``tools/check_gpu.py``'s memory checks whose logic runs anywhere (``tests/test_memory_ledger.py``).

``VMM`` allocates device memory the way vLLM's sleep-mode allocator does when an engine wakes up
(``vllm/device_allocator/cumem.py`` -> its ``cumem_allocator`` C extension: ``cuMemCreate`` of a pinned device
allocation, ``cuMemAddressReserve``, ``cuMemMap``, ``cuMemSetAccess``), through the CUDA driver API called with
ctypes on ``libcuda.so.1`` (the ``cuda-python`` bindings are not installed). After the trainer's ``offload()``
the check asks it for the bytes the offload freed: vLLM's wake-up succeeds only if torch's caching allocator
really gave them back to the driver.

``twin_steps`` runs two copies of a model: a plain one, and one whose gradient buffers and optimizer state go
through the loop's memory moves between steps (offload before the engine wakes, the save's onload of the
optimizer state without the gradients, a checkpoint written, the onload of the next update), and says whether
their parameters stay bit-exact.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

# CUDA driver API constants (cuda.h, CUDA 12)
CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class CUmemAllocationFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class CUmemAllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", CUmemLocation),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", CUmemAllocationFlags)]


class CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("location", CUmemLocation), ("flags", ctypes.c_int)]


class CudaError(RuntimeError):
    """A CUDA driver call returned an error (``code``: CUresult; 2 is CUDA_ERROR_OUT_OF_MEMORY)."""

    def __init__(self, call: str, code: int):
        super().__init__(f"{call} returned CUresult {code}" + (" (out of memory)" if code == 2 else ""))
        self.code = code


def round_up(n: int, granularity: int) -> int:
    return -(-n // granularity) * granularity


@dataclass
class Mapping:
    handle: ctypes.c_ulonglong
    address: ctypes.c_ulonglong
    size: int


class VMM:
    """The driver's virtual-memory calls on ``device``; ``lib``: libcuda (a stand-in in tests)."""

    def __init__(self, device: int = 0, lib=None):
        self.lib = ctypes.CDLL("libcuda.so.1") if lib is None else lib
        self.device = device
        self._call("cuInit", 0)

    def _call(self, name: str, *args) -> None:
        code = getattr(self.lib, name)(*args)
        if code != 0:
            raise CudaError(name, code)

    def _prop(self) -> CUmemAllocationProp:
        prop = CUmemAllocationProp()
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location = CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, self.device)
        return prop

    def granularity(self) -> int:
        g = ctypes.c_size_t(0)
        self._call("cuMemGetAllocationGranularity", ctypes.byref(g), ctypes.byref(self._prop()),
                   CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        return g.value

    def allocate(self, nbytes: int) -> Mapping:
        """``nbytes`` (rounded up to the granularity) created, reserved, mapped and made read-write, as vLLM's
        ``create_and_map``; raises ``CudaError`` (``code`` 2: out of memory) if the device cannot."""
        size = round_up(nbytes, self.granularity())
        handle, address = ctypes.c_ulonglong(0), ctypes.c_ulonglong(0)
        self._call("cuMemCreate", ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(self._prop()),
                   ctypes.c_ulonglong(0))
        try:
            self._call("cuMemAddressReserve", ctypes.byref(address), ctypes.c_size_t(size), ctypes.c_size_t(0),
                       ctypes.c_ulonglong(0), ctypes.c_ulonglong(0))
            self._call("cuMemMap", address, ctypes.c_size_t(size), ctypes.c_size_t(0), handle, ctypes.c_ulonglong(0))
            access = CUmemAccessDesc(CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, self.device),
                                     CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            self._call("cuMemSetAccess", address, ctypes.c_size_t(size), ctypes.byref(access), ctypes.c_size_t(1))
        except CudaError:
            self._call("cuMemRelease", handle)
            raise
        return Mapping(handle, address, size)

    def free(self, m: Mapping) -> None:
        """Unmap, release and unreserve, as vLLM's ``unmap_and_release``."""
        self._call("cuMemUnmap", m.address, ctypes.c_size_t(m.size))
        self._call("cuMemRelease", m.handle)
        self._call("cuMemAddressFree", m.address, ctypes.c_size_t(m.size))


def twin_steps(plain, offloaded, step: Callable[[object], None], save: Callable[[object], None],
               steps: int = 3) -> list[bool]:
    """Run ``steps`` updates on both twins (``step(twin)``); between updates the ``offloaded`` twin goes through
    the loop's moves: ``offload()`` (the engine wakes), ``onload(gradients=False)`` + ``offload(optimizer=False)``
    + ``save(twin)`` (a checkpoint), ``offload()`` (the engine wakes again); its next ``step`` onloads. Each twin
    is an object with ``parameters()`` and, for the offloaded one, ``training_state`` (``TrainingStateOffload``).
    Returns, per step, whether every parameter of the twins is bit-exact."""
    import torch

    same = []
    for _ in range(steps):
        step(plain)
        offloaded.training_state.onload()
        step(offloaded)
        same.append(all(torch.equal(a, b) for a, b in zip(plain.parameters(), offloaded.parameters(), strict=True)))
        state = offloaded.training_state
        state.offload()
        state.onload(gradients=False)
        state.offload(optimizer=False)
        save(offloaded)
        state.offload()
    return same
