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


GiB = 1024**3


class PhaseMemory:
    """What each phase of a step really held on this rank's GPU, for the metrics beside ``megareason plan``'s
    columns: ``torch.cuda.mem_get_info``'s used bytes (every process on the device: the trainer, vLLM, what lies
    outside torch's allocator) when the phase ends, and this process's allocator peak during it
    (``max_memory_allocated`` after ``reset_peak_memory_stats``). ``cuda``: ``torch.cuda`` (a stand-in in tests);
    without a device every call is a no-op and ``report`` is empty."""

    def __init__(self, cuda=None):
        self.cuda = torch.cuda if cuda is None else cuda
        self._seen: dict[str, tuple[int, int]] = {}  # phase -> (largest used, largest allocator peak) since report

    def enter(self) -> bool:
        if not self.cuda.is_available():
            return False
        self.cuda.reset_peak_memory_stats()
        return True

    def leave(self, phase: str) -> None:
        free, total = self.cuda.mem_get_info()
        used, peak = total - free, self.cuda.max_memory_allocated()
        old = self._seen.get(phase, (0, 0))
        self._seen[phase] = (max(old[0], used), max(old[1], peak))

    def report(self) -> dict[str, float]:
        """``memory/<phase>/used_gib`` and ``memory/<phase>/allocator_peak_gib`` of the phases since the last
        report (the largest of each phase's calls), then forgets them."""
        out = {}
        for phase, (used, peak) in self._seen.items():
            out[f"memory/{phase}/used_gib"] = used / GiB
            out[f"memory/{phase}/allocator_peak_gib"] = peak / GiB
        self._seen = {}
        return out


def recorded(method, phase: str):
    """``method`` of a worker, its call recorded as ``phase`` in the worker's ``phase_memory``."""
    import functools

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        memory = self.__dict__.setdefault("phase_memory", PhaseMemory())
        on = memory.enter()
        try:
            return method(self, *args, **kwargs)
        finally:
            if on:
                memory.leave(phase)

    return call


def record_phases(phases: dict[type, dict[str, str]]) -> None:
    """Wrap each ``class -> {method: phase}`` method with ``recorded`` (the workers' phases, ``trainer/workers.py``)."""
    for cls, methods in phases.items():
        for name, phase in methods.items():
            setattr(cls, name, recorded(getattr(cls, name), phase))
