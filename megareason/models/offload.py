"""The trainer's optimizer state and gradient buffers in host memory while vLLM holds the GPU.

Colocated, vLLM's weights and KV cache and Megatron's resident states share each GPU while the engine
generates. The states Megatron needs only inside an update are the largest part of them: the fp32 gradient
buffers of DDP (4 bytes per parameter) and the optimizer's fp32 main weights and Adam moments (8–12 bytes per
parameter, ÷ DP with the distributed optimizer). NeMo-RL (``offload_before_refit``) and verl
(``optimizer_offload``, ``grad_offload``) move them to host memory before the rollout engine wakes; so does
``trainer.offload_optimizer`` here.

How: each tensor's storage is emptied in place (``untyped_storage().resize_(0)``) after its bytes are copied
to (pinned) host memory, and refilled before the next update; the tensors, their views (DDP's ``main_grad``
views into the gradient buffer, the optimizer's references to its main weights) and the optimizer's
bookkeeping stay the same objects, so nothing is rebuilt. Gradient buffers are not copied: every update
starts by zeroing them (``optimizer.zero_grad``). Storages the model's parameters live in are never touched
(an fp32 model's distributed optimizer uses views of the parameters as its main weights).
"""

from __future__ import annotations

import torch


def _optimizers(optimizer) -> list:
    """megatron-core's optimizers under ``optimizer`` (a ``ChainedOptimizer`` holds one per parameter kind)."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _storage_key(t: torch.Tensor) -> tuple:
    """Which storage ``t`` views (an emptied storage has no address: those are skipped by their size)."""
    s = t.untyped_storage()
    return (s.device.type, s.device.index, s.data_ptr())


class TrainingStateOffload:
    """Offload and onload the gradient buffers of ``ddp`` and the state of ``optimizer`` (module docstring).
    ``offload(optimizer=False)`` frees the gradient buffers alone (a checkpoint save needs the optimizer
    state, never the gradients); what is already offloaded stays so. ``onload`` brings everything back, or
    with ``gradients=False`` the optimizer state alone (the gradient buffers stay empty).
    ``offloaded_bytes``: what is off the device now."""

    def __init__(self, ddp, optimizer):
        self._ddp, self._optimizer = ddp, optimizer
        self._host: list[tuple[torch.Tensor, torch.Tensor | None, int]] = []  # (tensor, host copy, nbytes)

    @property
    def offloaded(self) -> bool:
        return bool(self._host)

    @property
    def offloaded_bytes(self) -> int:
        return sum(n for _, _, n in self._host)

    def _tensors(self) -> list[tuple[torch.Tensor, bool]]:
        """(tensor, keep its values) with a storage of its own: gradient buffers (values dropped), then the
        optimizer's main weights and its per-parameter state (values kept), each storage once."""
        keep_out = {_storage_key(p) for p in self._ddp.parameters()}
        seen, out = set(keep_out), []
        host_too = not torch.cuda.is_available()  # on GPU machines only device tensors (Adam's step is on the host)

        def add(t, keep: bool) -> None:
            if (isinstance(t, torch.Tensor) and t.numel() and (t.is_cuda or host_too)
                    and _storage_key(t) not in seen):
                seen.add(_storage_key(t))
                out.append((t, keep))

        for buffer in [*getattr(self._ddp, "buffers", []), *getattr(self._ddp, "expert_parallel_buffers", [])]:
            add(buffer.grad_data, False)
        for opt in _optimizers(self._optimizer):
            inner = opt.optimizer
            for group in inner.param_groups:
                for p in group["params"]:
                    add(p, True)
                    for value in inner.state.get(p, {}).values():
                        add(value, True)
        return out

    def offload(self, optimizer: bool = True) -> None:
        cuda = torch.cuda.is_available()
        entries = []
        for t, keep in self._tensors():
            if (keep and not optimizer) or t.untyped_storage().nbytes() == 0:  # not asked for, or offloaded
                continue
            host = None
            if keep:
                host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=cuda and t.is_cuda)
                host.copy_(t.detach(), non_blocking=True)
            entries.append((t, host, t.untyped_storage().nbytes()))
        if cuda:
            torch.cuda.synchronize()  # the copies have finished before their device storage is freed
        for t, _, _ in entries:
            t.untyped_storage().resize_(0)
        self._host += entries
        if cuda and entries:
            torch.cuda.empty_cache()  # freed blocks go back to the device, where vLLM allocates its own

    def onload(self, gradients: bool = True) -> None:
        back = [e for e in self._host if gradients or e[1] is not None]
        for t, host, nbytes in back:
            t.untyped_storage().resize_(nbytes)
            if host is None:
                t.detach().zero_()
            else:
                t.detach().copy_(host, non_blocking=True)
        if torch.cuda.is_available() and back:
            torch.cuda.synchronize()  # the host copies may be freed
        self._host = [e for e in self._host if e[1] is None and not gradients]
