"""Memory measured from live tensors, to check ``megareason plan``'s figures (``tools/bench_memory.py``).

``state_bytes`` counts what a trained role keeps between steps on this rank: its parameters, the
gradient buffers megatron-core's DDP accumulates into (``main_grad``), and the optimizer's state (fp32
main weights of a mixed-precision optimizer, Adam's two moments; sharded over data-parallel ranks
under the distributed optimizer). ``SavedActivations`` counts the bytes autograd saves for the
backward pass while it is entered (``torch.autograd.graph.saved_tensors_hooks``): each storage once,
parameters excluded, so what is left is the activations of the forward passes run inside it.
"""

from __future__ import annotations

import torch


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _unique_storage_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def state_bytes(ddp_model, optimizer) -> dict[str, int]:
    """This rank's bytes of ``parameters`` (the model's own, in its precision), ``gradients`` (DDP's
    grad buffers) and ``optimizer_state`` (main weights, when the optimizer keeps a separate copy, plus
    every tensor of torch's optimizer state: Adam's ``exp_avg`` and ``exp_avg_sq``)."""
    params = list(ddp_model.module.parameters())
    grads = sum(_bytes(buf.grad_data) for buf in ddp_model.buffers + ddp_model.expert_parallel_buffers)
    # By storage: megatron-core DDP lays the parameters out in one buffer, and an fp32 run's distributed
    # optimizer steps views (shards) of it, which are the model's own weights, not main weights.
    model_storages = {p.untyped_storage().data_ptr() for p in params}
    state = 0
    for opt in _optimizers(optimizer):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if p.untyped_storage().data_ptr() not in model_storages:  # a separate fp32 main weight (or shard)
                    state += _bytes(p)
                for value in inner.state.get(p, {}).values():
                    if isinstance(value, torch.Tensor) and value.numel() > 1:
                        state += _bytes(value)
    return {"parameters": sum(_bytes(p) for p in params), "gradients": grads, "optimizer_state": state}


class SavedActivations:
    """``with SavedActivations(model) as saved: loss.backward()`` ... ``saved.bytes``: the bytes autograd
    saved for backward inside the block, each storage counted once, ``model``'s parameters excluded."""

    def __init__(self, model: torch.nn.Module):
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._saved: list[torch.Tensor] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in self._params:
            self._saved.append(t)
        return t

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        """The bytes saved so far: the whole size of each distinct storage (not only the part a view covers)."""
        return _unique_storage_bytes(self._saved)


def main_parameters(optimizer) -> dict[torch.Tensor, torch.Tensor]:
    """Model parameter -> its fp32 main weight in a mixed-precision ``optimizer`` (megatron-core's
    ``Float16OptimizerWithFloat16Params``, or its ``DistributedOptimizer`` at one data-parallel rank,
    where each rank's shard is the whole parameter, flattened). Parameters kept in fp32 are absent."""
    from megatron.core.optimizer import DistributedOptimizer

    out = {}
    for opt in _optimizers(optimizer):
        if isinstance(opt, DistributedOptimizer):
            for model_group, main_group in zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups,
                                               strict=True):
                for p, m in zip(model_group, main_group, strict=True):
                    assert m.numel() == p.numel(), "main weights are read at one data-parallel rank only"
                    out[p] = m
        elif hasattr(opt, "float16_groups"):
            for model_group, main_group in zip(opt.float16_groups, opt.fp32_from_float16_groups, strict=True):
                out.update(zip(model_group, main_group, strict=True))
    return out
