"""Buckets of weights passed from the trainer to vLLM's workers without copying them through RPC.

vLLM's ``collective_rpc`` moves bulk bytes slowly (tensors even become nested lists), so the bytes go
through memory both sides can map and only a small *transport* (where the memory is) and the *specs*
(name, dtype, shape, byte offset per tensor) cross the RPC:

* ``SharedBucket`` (CPU): a file in tmpfs (``/dev/shm``), mapped by both processes.
* ``CudaIpcBucket`` (GPU, colocated): a CUDA buffer shared through a CUDA IPC handle. Written for the
  GPU path and not exercised on these GPU-less machines.

Both fill by ``add`` (one copy in) up to a capacity, grown only for a single larger tensor.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence

import torch

Spec = tuple[str, str, list[int], int]  # (name, dtype, shape, byte offset)
Transport = tuple  # ("shm", path) or ("cuda_ipc", rebuild args)


class _Bucket:
    def __init__(self, capacity: int):
        self.capacity, self.used = 0, 0
        self.specs: list[Spec] = []
        self.buf: torch.Tensor | None = None
        self._grow(capacity)

    def _grow(self, nbytes: int) -> None:
        raise NotImplementedError

    def add(self, name: str, tensor: torch.Tensor) -> bool:
        """Copy ``tensor`` in; False (and nothing copied) when it does not fit next to what is there."""
        n = tensor.numel() * tensor.element_size()
        if self.used + n > self.capacity:
            if self.specs:
                return False
            self._grow(n)
        self.buf[self.used : self.used + n].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        self.specs.append((name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), self.used))
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
    def __init__(self, capacity: int):
        fd, self.path = tempfile.mkstemp(prefix="megareason-weights-", dir=shared_dir())
        os.close(fd)
        super().__init__(capacity)

    def _grow(self, nbytes: int) -> None:
        self.buf = None
        os.truncate(self.path, nbytes)
        self.buf, self.capacity = _file_storage(self.path, nbytes), nbytes

    def transport(self) -> Transport:
        return ("shm", self.path)

    def close(self) -> None:
        super().close()
        if os.path.exists(self.path):
            os.unlink(self.path)


class CudaIpcBucket(_Bucket):
    def _grow(self, nbytes: int) -> None:
        from torch.multiprocessing.reductions import reduce_tensor

        self.buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.capacity = nbytes
        self._ipc_args = reduce_tensor(self.buf)[1]

    def transport(self) -> Transport:
        torch.cuda.synchronize()  # the copies into the buffer must be done before the worker reads it
        return ("cuda_ipc", self._ipc_args)


def new_bucket(capacity: int) -> _Bucket:
    return SharedBucket(capacity) if not torch.cuda.is_available() else CudaIpcBucket(capacity)


def read_bucket(transport: Transport, specs: Sequence[Spec]) -> tuple[list[str], list[torch.Tensor]]:
    """The worker side: views of the bucket's tensors (copy them before the trainer refills it)."""
    kind, where = transport
    if kind == "shm":
        buf = _file_storage(where, os.path.getsize(where))
    elif kind == "cuda_ipc":
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        buf = rebuild_cuda_tensor(*where)
    else:
        raise ValueError(f"unknown bucket transport {kind!r}")
    names, tensors = [], []
    for name, dtype, shape, off in specs:
        dt = getattr(torch, dtype)
        n = dt.itemsize * (int(torch.tensor(shape).prod()) if shape else 1)
        names.append(name)
        tensors.append(buf[off : off + n].view(dt).view(shape))
    return names, tensors
