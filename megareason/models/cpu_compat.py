"""megatron-core 0.16.1 on a machine without CUDA: the few patches it needs, in one place.

megatron-core assumes CUDA in a handful of calls that are not about the math: device placement,
synchronisation and RNG bookkeeping. On CPU (torch.distributed with gloo) each of those maps onto an
obvious CPU equivalent, and the model code runs unchanged. ``apply()`` installs them only when CUDA is
absent and is idempotent; on a GPU it does nothing, so the GPU path is stock megatron-core.

Each patch names the megatron-core call it covers; ``tests/test_cpu_compat.py`` has one test each.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

_applied = False


class CudaToCpuMode(TorchFunctionMode):
    """Redirects ``device="cuda"`` in factory calls and ``Tensor.cuda()`` / ``.to("cuda")`` to the CPU.

    Covers ``torch.zeros([], dtype=torch.int, device="cuda")`` in
    ``pipeline_parallel/schedules.py`` (the token count of every forward-backward schedule), the
    ``torch.tensor([...], device="cuda")`` scalars of ``optimizer/optimizer.py`` and ``clip_grads.py``,
    and ``Tensor.cuda()`` in ``models/common/language_module/language_module.py`` (the tied
    embedding weight is all-reduced between the first and last pipeline stage).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # tensor.type() names the CUDA tensor type: megatron-core's mixed-precision and distributed
            # optimizers sort parameters by it ("Wrapped parameters must be one of torch.cuda.FloatTensor,
            # torch.cuda.HalfTensor, or torch.cuda.BFloat16Tensor" in optimizer/optimizer.py and
            # optimizer/distrib_optimizer.py).
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


def _cpu_current_device() -> str:
    return "cpu"


def _noop(*args, **kwargs) -> None:
    return None


def _cpu_get_rng_state(device=None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device=None, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    torch.manual_seed(seed)


class _CpuEvent:
    def synchronize(self) -> None:
        return None


class CpuStream:
    """Stands in for ``torch.cuda.Stream`` where there is no CUDA: everything runs in order on the CPU,
    so waiting on a stream or an event it recorded is immediate."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        return None

    def record_event(self, event=None) -> _CpuEvent:
        return _CpuEvent()

    def synchronize(self) -> None:
        return None


_CURRENT_STREAM = CpuStream()


def _cpu_current_stream(device=None) -> CpuStream:
    return _CURRENT_STREAM


def _cpu_stream_context(stream):
    from contextlib import nullcontext

    return nullcontext(stream)


def apply() -> bool:
    """Install the patches when CUDA is absent. Returns whether they are (now) installed."""
    global _applied
    if _applied:
        return True
    if torch.cuda.is_available():
        return False
    from megatron.core.tensor_parallel import random as mcore_random

    # (1) torch.cuda.current_device(): used as the device of buffers and communication tensors
    #     (rotary_pos_embedding.RotaryEmbedding.get_emb, p2p_communication._communicate_shapes, DDP
    #     buffers, tensor_parallel.layers weight allocation).
    torch.cuda.current_device = _cpu_current_device
    # (2) torch.cuda.synchronize(): called around p2p sends in p2p_communication._communicate.
    torch.cuda.synchronize = _noop
    # (3) The model-parallel RNG tracker (tensor_parallel.random.CudaRNGStatesTracker.add / fork)
    #     saves and restores CUDA generator states; keep them on the CPU generator instead.
    torch.cuda.get_rng_state = _cpu_get_rng_state
    torch.cuda.set_rng_state = _cpu_set_rng_state
    torch.cuda.manual_seed = _cpu_manual_seed
    mcore_random._get_cuda_rng_state = _cpu_get_rng_state
    mcore_random._set_cuda_rng_state = _cpu_set_rng_state
    # (4) device="cuda" factory calls and Tensor.cuda(): see CudaToCpuMode. The mode is entered for
    #     the life of the process (megatron-core makes these calls from the training thread).
    CudaToCpuMode().__enter__()
    # (7) MoE's all-to-all token dispatcher (transformer/moe/token_dispatcher.MoEAlltoAllTokenDispatcher)
    #     creates a side ``torch.cuda.Stream`` for its device-to-host copies of the token counts, enters
    #     it with ``torch.cuda.stream``, compares it with ``torch.cuda.current_stream()`` and waits on an
    #     event it records: CpuStream, on which all of that is immediate.
    torch.cuda.Stream = CpuStream
    torch.cuda.current_stream = _cpu_current_stream
    torch.cuda.stream = _cpu_stream_context
    _apply_moe_patches()
    _apply_optimizer_patches()
    _applied = True
    return True


def _apply_moe_patches() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    # (8) The same dispatcher turns its split sizes into numpy arrays with
    #     moe_utils.maybe_move_tensor_to_cpu(..., as_numpy=True), which converts only CUDA tensors; the
    #     CPU tensors it leaves are refused by gloo's all_to_all_single (it wants a sequence of ints).
    moe_utils.maybe_move_tensor_to_cpu = _cpu_maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = _cpu_maybe_move_tensor_to_cpu
    # (9) With TP > 1 the dispatcher gathers the tokens routed to this TP group's experts with an uneven
    #     all-gather (tensor_parallel.mappings._gather_along_first_dim with output_split_sizes) and returns
    #     their outputs with an uneven reduce-scatter (_reduce_scatter_along_first_dim with
    #     input_split_sizes); gloo has neither. The same results from the collectives it has: an even
    #     all-gather of zero-padded pieces, and an all-reduce of which each rank keeps its own piece.
    from megatron.core.tensor_parallel import mappings

    even_gather, even_reduce_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return even_gather(input_, group, output_split_sizes, use_global_buffer)
        return _uneven_all_gather(input_, group, [int(n) for n in output_split_sizes])

    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return even_reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        return _uneven_reduce_scatter(input_, group, [int(n) for n in input_split_sizes])

    mappings._gather_along_first_dim = gather
    mappings._reduce_scatter_along_first_dim = reduce_scatter


def _uneven_all_gather(input_: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    import torch.distributed as dist

    longest = max(sizes)
    padded = input_.new_zeros(longest, *input_.shape[1:])
    padded[: input_.shape[0]] = input_
    pieces = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(pieces, padded.contiguous(), group=group)
    return torch.cat([piece[:n] for piece, n in zip(pieces, sizes, strict=True)])


def _uneven_reduce_scatter(input_: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    import torch.distributed as dist

    total = input_.contiguous().clone()
    dist.all_reduce(total, group=group)
    return total.split(sizes, dim=0)[group.rank()].contiguous()


def _cpu_maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _apply_optimizer_patches() -> None:
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mcore_optimizer

    # (5) clip_grads.clip_grad_by_total_norm_fp32 asserts ``grad.type() == 'torch.cuda.FloatTensor'``
    #     and scales with the fused multi_tensor_scale; MegatronOptimizer.clip_grad_norm calls it
    #     through the name imported into optimizer.py, so both names are replaced.
    clip_grads.clip_grad_by_total_norm_fp32 = _cpu_clip_grad_by_total_norm_fp32
    mcore_optimizer.clip_grad_by_total_norm_fp32 = _cpu_clip_grad_by_total_norm_fp32
    _apply_recompute_patches()


def _apply_recompute_patches() -> None:
    from megatron.core.fusions import fused_softmax

    # (6) fusions/fused_softmax.FusedScaleMaskSoftmax builds its causal mask with
    #     transformer/utils.get_default_causal_mask (``device="cuda"``). Under activation recomputation
    #     it runs again inside the backward pass, and torch 2.13 dispatches ``torch.autograd.backward``
    #     through ``__torch_function__``, which pops CudaToCpuMode for the whole backward pass.
    fused_softmax.get_default_causal_mask = _cpu_default_causal_mask


def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def _cpu_clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for p in params:
            grad = p.decoupled_grad if use_decoupled_grad else p.grad
            if grad is not None:
                grad.detach().mul_(clip_coeff)
