"""Process groups for tensor / pipeline / data parallelism: NCCL on GPU, gloo on CPU, the same code."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# How long a collective waits for its slowest rank before it fails, in the default process group and in
# megatron-core's groups. The longest wait in a healthy run is a checkpoint save: the ranks that are done
# writing wait for the slowest node, which writes about checkpoint bytes / nodes (models/checkpoint.py),
# ~120 GB for a 70B run on 8 nodes: a minute at 2 GB/s, 20 minutes at 0.1 GB/s. torch's default for NCCL
# is 10 minutes. A rank that dies is reported by Ray at once (trainer/group.py) without waiting for this.
COLLECTIVE_TIMEOUT = timedelta(minutes=60)


@dataclass(frozen=True)
class Layout:
    """This rank's place in the TP x PP x DP grid (megatron-core's order: TP fastest, then DP, then PP)."""

    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    # Expert parallelism (MoE): the experts are split over ``ep`` ranks carved out of data parallelism
    # (ranks of the same TP and PP rank, consecutive DP ranks); 1 for a dense model.
    ep: int = 1
    ep_rank: int = 0

    @property
    def first_stage(self) -> bool:
        """Whether this rank's pipeline stage holds the embedding (reads the token ids)."""
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        """Whether this rank's pipeline stage holds the output layer (produces the logits)."""
        return self.pp_rank == self.pp - 1


def init_parallel(tp: int = 1, pp: int = 1, seed: int = 0, ep: int = 1, store=None) -> Layout:
    """Join the default process group and build megatron's groups: through ``store`` (a
    ``torch.distributed.Store``; RANK and WORLD_SIZE from the environment) when given, else torchrun-style
    environment variables (``env://``).

    The world size must be a multiple of ``tp * pp``; the rest is data parallel, of which ``ep`` ranks at
    a time share out the experts of an MoE model (``ep`` must divide the data-parallel size). Collectives
    time out after ``COLLECTIVE_TIMEOUT``. On a machine without CUDA the backend is gloo and ``cpu_compat``
    patches megatron-core's CUDA-only calls.
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from megareason.models import cpu_compat

    on_gpu = torch.cuda.is_available()
    if not dist.is_initialized():
        if on_gpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        backend = "nccl" if on_gpu else "gloo"
        if store is None:
            dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT)
        else:
            dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), timeout=COLLECTIVE_TIMEOUT)
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"world size {world} is not a multiple of TP x PP = {tp} x {pp}")
    if (world // (tp * pp)) % ep:
        raise ValueError(f"expert parallelism EP={ep} must divide the data-parallel size {world // (tp * pp)} "
                         f"(world {world} / TP {tp} / PP {pp})")
    if not on_gpu:
        cpu_compat.apply()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep,
                                 distributed_timeout_minutes=int(COLLECTIVE_TIMEOUT.total_seconds() // 60))
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return current_layout()


def current_layout() -> Layout:
    """This rank's ``Layout``, read from megatron-core's parallel state (which asserts if ``init_parallel``
    has not run). No collective."""
    from megatron.core import parallel_state as ps

    return Layout(
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        ep=ps.get_expert_model_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(),
    )


def destroy_parallel() -> None:
    """Undo ``init_parallel``: megatron-core's groups, then torch.distributed's default group; does
    nothing for what is not initialised."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
