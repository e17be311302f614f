"""Weights into separate engines on any node, by collective broadcast through vLLM's weight-transfer API.

One group holds the trainer's sending rank (rank 0) and every worker of every separate engine: engine ``e``
(of tensor-parallel size TP) has ranks ``1 + e·TP .. (e + 1)·TP``, its worker of TP rank ``r`` at ``1 + e·TP +
r``. After the trainer's PP/TP/EP gather (``HFWeightSource``), the sender packs the HF tensors into buckets and
broadcasts each bucket once to all engines at once; every worker loads what it received through the same
checked layerwise reload as the other paths (``vllm_worker._Reload``).

The control flow is vLLM 0.32's dense NCCL backend's (``vllm/distributed/weight_transfer/nccl_engine.py``):
``trainer_init`` starts the workers' ``init_weight_transfer_engine`` on a side thread while the sender opens
its end of the group (both block in the same rendezvous), and ``send_weights`` runs the workers'
``update_weights`` on a side thread while the sender broadcasts (both meet in the same collectives). Two
differences: each engine gets its own rank offset (vLLM's workers compute theirs from the data-parallel index
of ONE deployment, ``nccl_common.worker_init_process_group``, so separate ``LLM``s would all claim ranks 1 ..
TP), and each bucket is one chunk whose update info is its specs (name, dtype, shape, byte offset per
tensor), as for the tmpfs bucket: the buckets follow the order the trainer's gather yields the tensors,
which need not be the order of the weight map's shapes.

The group: on GPU vLLM's own weight-transfer communicator (``NcclGroup``: PyNccl over a
``StatelessProcessGroup``, as ``nccl_common.py`` builds it); on CPU a gloo group on the project's rendezvous
store (``GlooGroup``). Everything else is the same code on both. ``rollout.weight_transfer`` picks the
backend (``auto``: the tmpfs bucket of ``rollout.transfer`` when every engine shares the trainer's node, this
module otherwise).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from megareason.rollout.buckets import Spec
from megareason.rollout.records import WeightUpdate
from megareason.rollout.transfer import ReloadingEngine
from megareason.rollout.vllm_worker import BROADCAST_BACKEND

_PREFIX = "megareason_broadcast"
# A bucket's broadcast that has not completed in this time has a hung peer (a dead one fails at once: its
# socket closes): the run stops naming the engines instead of waiting out the 60-minute collective timeout.
TIMEOUT_S = 600.0


# ---- the wire: a bucket plan both sides follow -------------------------------------------------------------

def plan_buckets(meta: list[tuple[str, torch.dtype, tuple[int, ...]]], bucket_bytes: int) -> list[list[Spec]]:
    """Split tensors, in order, into buckets of at most ``bucket_bytes`` (a larger tensor gets a bucket of its
    own, as ``buckets._Bucket.add`` grows for it): per bucket, (name, dtype, shape, byte offset) per tensor.
    ``meta`` gives (name, dtype, shape) in the order the source yields them."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[list[Spec]] = []
    used = 0
    for name, dtype, shape in meta:
        n = _numel(shape) * dtype.itemsize
        if not buckets or used + n > bucket_bytes:
            buckets.append([])
            used = 0
        buckets[-1].append((name, str(dtype).removeprefix("torch."), list(shape), used))
        used += n
    return buckets


def bucket_size(specs: list[Spec]) -> int:
    name, dtype, shape, offset = specs[-1]
    return offset + _numel(shape) * getattr(torch, dtype).itemsize


def unpack(buf: torch.Tensor, specs: list[Spec]) -> tuple[list[str], list[torch.Tensor]]:
    """The HF-named views of a received bucket (``buf``: uint8, ``bucket_size(specs)`` bytes)."""
    names, views = [], []
    for name, dtype, shape, offset in specs:
        dt = getattr(torch, dtype)
        n = _numel(shape) * dt.itemsize
        names.append(name)
        views.append(buf[offset:offset + n].view(dt).view(shape))
    return names, views


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


@dataclass
class Listening:
    """Rank 0's end of a group before the others join: where it listens, and ``join()``, which blocks until
    every rank has joined and returns the group."""

    port: int
    join: Callable[[], object]


class GlooGroup:
    """CPU: a gloo process group of its own (not torch.distributed's default group, which the trainer and each
    vLLM engine already use) on a TCP store: rank 0 hosts the store, the others connect to ``host:port``."""

    device = "cpu"

    def __init__(self, store, rank: int, world: int, timeout_s: float):
        self.rank, self.world = rank, world
        self.pg = torch.distributed.ProcessGroupGloo(torch.distributed.PrefixStore(_PREFIX, store), rank, world,
                                                     timedelta(seconds=timeout_s))

    @classmethod
    def open(cls, host: str, world: int, timeout_s: float) -> Listening:
        """Rank 0: the store on a port of the run's block (``ports.rendezvous_store``)."""
        from megareason.ports import rendezvous_store

        store = rendezvous_store(host, world, timedelta(seconds=timeout_s))
        return Listening(store.port, lambda: cls(store, 0, world, timeout_s))

    @classmethod
    def join(cls, host: str, port: int, rank: int, world: int, timeout_s: float) -> GlooGroup:
        store = torch.distributed.TCPStore(host, port, world, is_master=False, timeout=timedelta(seconds=timeout_s))
        return cls(store, rank, world, timeout_s)

    def broadcast(self, buf: torch.Tensor) -> None:
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([buf], opts).wait()


class NcclGroup:
    """GPU: vLLM's own communicator for weight transfer, as its NCCL backend builds it
    (``nccl_common.stateless_init_process_group``): a ``StatelessProcessGroup`` (a TCP store, rank 0 its
    server) and a ``PyNcclCommunicator`` on this process's device, created under ``unpinned_nccl_env`` (the
    NCCL settings vLLM pins for its own groups must not leak into one shared with the trainer). Rank 0 listens
    on a socket the run's port block bound first (``StatelessProcessGroup.create(listen_socket=...)``). The
    broadcast runs on the current stream and is waited for, so a bucket may be reused as soon as it returns.
    Not run on these GPU-less machines."""

    device = "cuda"

    def __init__(self, host: str, port: int, rank: int, world: int, timeout_s: float, listen_socket=None):
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup
        from vllm.utils.nccl import unpinned_nccl_env

        pg = StatelessProcessGroup.create(host, port, rank, world, store_timeout=int(timeout_s),
                                          listen_socket=listen_socket)
        with unpinned_nccl_env():
            self.comm = PyNcclCommunicator(pg, device=torch.accelerator.current_device_index())

    @classmethod
    def open(cls, host: str, world: int, timeout_s: float) -> Listening:
        import socket

        from megareason.ports import RENDEZVOUS, bind_first, block_base

        def listen(port: int) -> socket.socket:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
            s.listen()
            return s

        base = block_base()
        sock = bind_first(listen, range(base, base + RENDEZVOUS), f"weight broadcast rendezvous on {host}")
        port = sock.getsockname()[1]
        return Listening(port, lambda: cls(host, port, 0, world, timeout_s, listen_socket=sock))

    @classmethod
    def join(cls, host: str, port: int, rank: int, world: int, timeout_s: float) -> NcclGroup:
        return cls(host, port, rank, world, timeout_s)

    def broadcast(self, buf: torch.Tensor) -> None:
        stream = torch.cuda.current_stream()
        self.comm.broadcast(buf, src=0, stream=stream)
        stream.synchronize()


def group_class():
    """The group this machine's engines and trainer meet in: NCCL where there is CUDA, gloo elsewhere."""
    return NcclGroup if torch.cuda.is_available() else GlooGroup


# ---- worker side (inside each vLLM worker process) ----------------------------------------------------------

@dataclass
class BroadcastInitInfo(WeightTransferInitInfo):
    """Where the group's store listens, this engine's first rank, the group's size, the collectives' timeout."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float


@dataclass
class BroadcastUpdateInfo(WeightTransferUpdateInfo):
    """One chunk: the bucket the sender broadcasts next, (name, dtype, shape, byte offset) per tensor."""

    specs: list


class BroadcastWeightTransferEngine(ReloadingEngine):
    """vLLM's worker-side engine for ``megareason_broadcast``: joins the group at its engine's offset plus its
    rank in the engine, receives each bucket and loads it through the checked layerwise reload."""

    init_info_cls = BroadcastInitInfo
    update_info_cls = BroadcastUpdateInfo

    def init_transfer_engine(self, init_info: BroadcastInitInfo) -> None:
        p = self.parallel_config
        rank = init_info.rank_offset + p.data_parallel_index * p.world_size + p.rank
        self.group = group_class().join(init_info.master_address, init_info.master_port, rank,
                                        init_info.world_size, init_info.timeout_s)
        self._reload = None

    def receive_weights(self, update_info: BroadcastUpdateInfo) -> None:
        specs = [tuple(s) for s in update_info.specs]
        # A fresh buffer per bucket: vLLM may keep views of it until their layer is complete.
        buf = torch.empty(bucket_size(specs), dtype=torch.uint8, device=self.group.device)
        self.group.broadcast(buf)
        names, views = unpack(buf, specs)
        self._reload.check(names, views)
        self._reload.load(names, views)

    def shutdown(self) -> None:
        self._reload = None
        self.group = None


# ---- trainer side -----------------------------------------------------------------------------------------

@dataclass
class BroadcastTrainerInitInfo(TrainerInitInfo):
    """``engine_sizes``: each engine's number of workers (its TP x PP); ``bucket_bytes``: the buckets' size."""

    backend: ClassVar[str] = BROADCAST_BACKEND
    host: str
    engine_sizes: list
    bucket_bytes: int
    timeout_s: float


def engine_offsets(engine_sizes: list[int]) -> list[int]:
    """Each engine's first rank in the group (the sender is rank 0)."""
    offsets, nxt = [], 1
    for size in engine_sizes:
        offsets.append(nxt)
        nxt += size
    return offsets


class BroadcastTrainerWeightTransferEngine(TrainerWeightTransferEngine[BroadcastTrainerInitInfo]):
    """The trainer side of ``megareason_broadcast``. The sender is rank 0 of the trainer's pushing ranks; the
    others iterate the source (its gathers) and send nothing. The client must offer ``init_each`` (one init
    payload per engine: ``rollout.transfer.PoolClient``)."""

    init_info_cls = BroadcastTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: BroadcastTrainerInitInfo, *, client, source=None):
        engine = cls(client=client, source=source, is_sender=init_info.rank == 0)
        engine.bucket_bytes, engine.dtype, engine.group = init_info.bucket_bytes, source.dtype, None
        if not engine.is_sender:
            return engine
        world = 1 + sum(init_info.engine_sizes)
        listening = group_class().open(init_info.host, world, init_info.timeout_s)
        payloads = [asdict(BroadcastInitInfo(init_info.host, listening.port, offset, world, init_info.timeout_s))
                    for offset in engine_offsets(init_info.engine_sizes)]
        with ThreadPoolExecutor(max_workers=1) as exe:  # the workers block in the rendezvous, as does the sender
            future = exe.submit(client.init_each, payloads)
            engine.group = listening.join()
            future.result()
        return engine

    def send_weights(self, weight_version: str | None = None) -> WeightUpdate:
        start = time.perf_counter()
        if not self.is_sender:
            for _ in self.source:
                pass
            return WeightUpdate(0, 0, 0, time.perf_counter() - start, 0.0)
        waited, sizes = self.client.seconds, []
        self.client.start_weight_update()
        exe = ThreadPoolExecutor(max_workers=1)
        try:
            for specs, buf in self._buckets():
                # The engines' update_weights (they receive) runs beside the broadcast: both meet in it.
                future = exe.submit(self.client.update_weights, {"specs": specs})
                self.group.broadcast(buf)
                future.result()  # the engines' own errors (a tensor the served model refuses, ...)
                sizes.append(buf.numel())
        except BaseException:
            # No finish_weight_update and no join: after a failed broadcast the engines are blocked in the
            # matching collective until it fails there too (their sockets, or TIMEOUT_S), and a call queued
            # behind it would hang; the group is unusable and the run stops (vLLM's NCCL trainer does the same).
            exe.shutdown(wait=False)
            raise
        exe.shutdown(wait=False)
        self.client.finish_weight_update(weight_version)
        return WeightUpdate(bytes=sum(sizes), buckets=len(sizes), largest_bucket=max(sizes, default=0),
                            seconds=time.perf_counter() - start, vllm_seconds=self.client.seconds - waited)

    def _buckets(self):
        """(specs, filled uint8 buffer) per bucket, in the order the source yields the tensors (each in the
        engines' dtype); a bucket is full at ``bucket_bytes`` (a larger tensor gets one of its own)."""
        pending: list[tuple[str, torch.Tensor]] = []
        used = 0
        for name, tensor in self.source:
            n = tensor.numel() * self.dtype.itemsize
            if pending and used + n > self.bucket_bytes:
                yield self._fill(pending)
                pending, used = [], 0
            pending.append((name, tensor))
            used += n
        if pending:
            yield self._fill(pending)

    def _fill(self, pending: list[tuple[str, torch.Tensor]]) -> tuple[list, torch.Tensor]:
        specs = plan_buckets([(n, self.dtype, tuple(t.shape)) for n, t in pending], bucket_bytes=1 << 62)[0]
        buf = torch.empty(bucket_size(specs), dtype=torch.uint8, device=self.group.device)
        for spec, (_, tensor) in zip(specs, pending, strict=True):
            offset = spec[3]
            buf[offset:offset + tensor.numel() * self.dtype.itemsize].view(self.dtype).view(tensor.shape).copy_(tensor)
        return [list(s) for s in specs], buf

    def shutdown(self) -> None:
        self.group = None

