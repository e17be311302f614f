"""Buckets of weights passed from the trainer to vLLM's workers without copying them through RPC.

vLLM's ``collective_rpc`` moves bulk bytes slowly (tensors even become nested lists), so the bytes go
through memory both sides can map and only a small *transport* (where the memory is) and the *specs*
(name, dtype, shape, byte offset per tensor) cross the RPC:

* ``SharedBucket`` (CPU): a file in tmpfs (``/dev/shm``), mapped by both processes.
* ``CudaIpcBucket`` (GPU, colocated): a CUDA buffer shared through a CUDA IPC handle, read on the worker
  side by vLLM's own packed-buffer import (``vllm.distributed.weight_transfer.packed_tensor``): the handle
  is keyed by the GPU's UUID and its device index rewritten to the worker's, the buffer is mapped once
  per export (``PackedBufferImporter``; mapping it per bucket drives torch's IPC reference count
  negative and leaks the buffer) and every tensor is copied out, and the copies synchronized, before the
  RPC returns, so the trainer may refill the buffer as soon as it does. Not exercised on these GPU-less
  machines.

Both fill by ``add`` (one copy in, cast to the engine's dtype in that copy) up to a capacity, grown only
for a single larger tensor.

Everything in a transport crosses vLLM's ``collective_rpc``, whose msgpack encoder takes only plain
values unless VLLM_ALLOW_INSECURE_SERIALIZATION=1: torch's ``reduce_tensor`` arguments hold a tensor
class, a storage class and a dtype, so ``ipc_transport`` names them and ``read_bucket`` restores them.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence

import torch

Spec = tuple[str, str, list[int], int]  # (name, dtype, shape, byte offset)
Transport = tuple  # ("shm", path) or ("cuda_ipc", {GPU UUID: reduce_tensor args with names for types})


class _Bucket:
    def __init__(self, capacity: int):
        self.capacity, self.used = 0, 0
        self.specs: list[Spec] = []
        self.buf: torch.Tensor | None = None
        self._grow(capacity)

    def _grow(self, nbytes: int) -> None:
        raise NotImplementedError

    def add(self, name: str, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
        """Copy ``tensor`` in, as ``dtype`` (default: its own); False (and nothing copied) when it does not
        fit next to what is there."""
        dtype = dtype or tensor.dtype
        n = tensor.numel() * dtype.itemsize
        if self.used + n > self.capacity:
            if self.specs:
                return False
            self._grow(n)
        self.buf[self.used : self.used + n].view(dtype).view(tensor.shape).copy_(tensor)
        self.specs.append((name, str(dtype).removeprefix("torch."), list(tensor.shape), self.used))
        self.used += n
        return True

    def transport(self) -> Transport:
        raise NotImplementedError

    def clear(self) -> None:
        self.specs, self.used = [], 0

    def close(self) -> None:
        self.buf = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def shared_dir() -> str:
    """Where bucket files live: tmpfs (/dev/shm) when the machine has it, so they never touch a disk."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _file_storage(path: str, nbytes: int) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage.from_file(path, True, nbytes))


class SharedBucket(_Bucket):
    """A bucket backed by a fresh file in ``shared_dir()`` (CPU engines), which ``close`` deletes: use it
    as a context manager, or the file outlives the run."""

    def __init__(self, capacity: int):
        fd, self.path = tempfile.mkstemp(prefix="megareason-weights-", dir=shared_dir())
        os.close(fd)
        super().__init__(capacity)

    def _grow(self, nbytes: int) -> None:
        self.buf = None
        os.truncate(self.path, nbytes)
        self.buf, self.capacity = _file_storage(self.path, nbytes), nbytes

    def transport(self) -> Transport:
        """``("shm", path)``: the worker maps the same file (``read_bucket``)."""
        return ("shm", self.path)

    def close(self) -> None:
        """Drop the mapping and delete the file (idempotent)."""
        super().close()
        if os.path.exists(self.path):
            os.unlink(self.path)


class CudaIpcBucket(_Bucket):
    """A bucket in a CUDA buffer on the current device, exported once per allocation through a CUDA IPC
    handle (GPU, engine colocated on the same GPU). Not exercised on GPU-less machines."""

    def _grow(self, nbytes: int) -> None:
        from torch.multiprocessing.reductions import reduce_tensor

        self.buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.capacity = nbytes
        # Exported once per allocation; the worker maps it once per export (see read_bucket).
        device = torch.cuda.current_device()
        self._transport = ipc_transport(reduce_tensor(self.buf)[1], str(torch.cuda.get_device_properties(device).uuid))

    def transport(self) -> Transport:
        """The buffer's IPC handle (``ipc_transport``); synchronizes the current stream first, so the
        copies made by ``add`` are complete before the worker reads."""
        torch.cuda.current_stream().synchronize()  # the copies into the buffer are done before the worker reads
        return self._transport

    def close(self) -> None:
        """Drop the buffer and collect the IPC memory the worker has released (``torch.cuda.ipc_collect``)."""
        super().close()
        torch.cuda.ipc_collect()  # free exported buffers the worker has released


_TENSOR_CLASSES = {"Tensor": torch.Tensor}
_STORAGE_CLASSES = {"TypedStorage": torch.TypedStorage, "UntypedStorage": torch.UntypedStorage}


def ipc_transport(ipc_args: Sequence, gpu_uuid: str) -> Transport:
    """The transport of a CUDA buffer exported by ``torch.multiprocessing.reductions.reduce_tensor`` (its
    rebuild arguments ``ipc_args``) on the GPU ``gpu_uuid``, in plain values only: the tensor class, the
    storage class and the dtype go by name, sizes and strides as lists (vLLM's msgpack encoder refuses
    the classes and the dtype)."""
    args = list(ipc_args)
    tensor_cls, storage_cls, dtype = args[0], args[4], args[5]
    names = {v: k for k, v in _TENSOR_CLASSES.items()}, {v: k for k, v in _STORAGE_CLASSES.items()}
    if tensor_cls not in names[0] or storage_cls not in names[1] or not isinstance(dtype, torch.dtype):
        raise TypeError(f"not the CUDA rebuild arguments of a plain tensor: {tensor_cls}, {storage_cls}, {dtype}")
    args[0], args[4], args[5] = names[0][tensor_cls], names[1][storage_cls], str(dtype).removeprefix("torch.")
    args[1], args[2] = list(args[1]), list(args[2])
    return ("cuda_ipc", {gpu_uuid: args})


def ipc_rebuild_args(wire: Sequence) -> list:
    """Inverse of ``ipc_transport`` for one GPU's arguments: what ``rebuild_cuda_tensor`` takes."""
    args = list(wire)
    if args[0] not in _TENSOR_CLASSES or args[4] not in _STORAGE_CLASSES:
        raise ValueError(f"bucket transport: unknown tensor/storage class {args[0]!r}/{args[4]!r}")
    dtype = getattr(torch, args[5], None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"bucket transport: unknown dtype {args[5]!r}")
    args[0], args[4], args[5] = _TENSOR_CLASSES[args[0]], _STORAGE_CLASSES[args[4]], dtype
    args[1], args[2] = torch.Size(args[1]), tuple(args[2])
    return args


_importer = None  # the worker's vllm PackedBufferImporter: one mapping per exported buffer


def release_imports() -> None:
    """Worker side, after the last bucket of an update: unmap the trainer's buffer (exactly once)."""
    if _importer is not None:
        _importer.close()


def new_bucket(capacity: int) -> _Bucket:
    """A bucket of ``capacity`` bytes for this machine: ``CudaIpcBucket`` when CUDA is available, else
    ``SharedBucket``. Use it as a context manager (``close`` frees the file or buffer)."""
    return SharedBucket(capacity) if not torch.cuda.is_available() else CudaIpcBucket(capacity)


def read_bucket(transport: Transport, specs: Sequence[Spec]) -> tuple[list[str], list[torch.Tensor]]:
    """The worker side. tmpfs: views of the bucket's tensors (copy them before the trainer refills it).
    CUDA IPC: copies, already complete on the device."""
    kind, where = transport
    if kind == "cuda_ipc":
        return _read_cuda_ipc(where, specs)
    if kind != "shm":
        raise ValueError(f"unknown bucket transport {kind!r}")
    buf = _file_storage(where, os.path.getsize(where))
    names, tensors = [], []
    for name, dtype, shape, off in specs:
        dt = getattr(torch, dtype)
        n = dt.itemsize * (int(torch.tensor(shape).prod()) if shape else 1)
        names.append(name)
        tensors.append(buf[off : off + n].view(dt).view(shape))
    return names, tensors


def _read_cuda_ipc(handles: dict, specs: Sequence[Spec]) -> tuple[list[str], list[torch.Tensor]]:
    global _importer
    from vllm.distributed.weight_transfer.packed_tensor import PackedBufferImporter, packed_ipc_consumer

    if _importer is None:
        _importer = PackedBufferImporter()
    sizes, at = [], 0
    for _, dtype, shape, off in specs:
        assert off == at, "bucket specs are packed back to back"
        sizes.append(getattr(torch, dtype).itemsize * int(torch.Size(shape).numel()))
        at += sizes[-1]
    named = packed_ipc_consumer({uuid: ipc_rebuild_args(a) for uuid, a in handles.items()}, [s[0] for s in specs],
                                [list(s[2]) for s in specs], [s[1] for s in specs], sizes,
                                torch.cuda.current_device(), importer=_importer)
    torch.cuda.current_stream().synchronize()  # copied out: the trainer may refill the buffer
    return [n for n, _ in named], [t for _, t in named]
