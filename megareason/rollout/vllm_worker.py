"""A vLLM worker extension that takes new weights in place, bucket by bucket.

vLLM loads it into each of its workers (``LLM(worker_extension_cls=...)``) and the engine calls its
methods through ``LLM.collective_rpc``. One update is ``mr_begin_weight_update``, then
``mr_load_bucket`` per bucket, then ``mr_finish_weight_update`` (prefixed: vLLM's worker has
methods with the plain names for its own GPU transfer engines). vLLM's layerwise reload is opened
once, each bucket's HF-named tensors go through the model's own ``load_weights`` (a layer is
processed as soon as all its tensors have arrived, so buckets need not align with layers), and the
reload is closed at the end: vLLM's ``reload_weights`` split across calls, so the weights never need
to be in one process at once. The bytes travel in ``rollout.buckets`` (tmpfs on CPU, CUDA IPC on GPU).

Every tensor is checked against the served model's own HF config first: an unknown name, a wrong
shape or a missing tensor fails loudly with the name (and both shapes), never loads silently.
"""

from __future__ import annotations

import re
import time

from megareason.rollout.buckets import Spec, Transport, read_bucket, release_imports


def _unit(name: str) -> str:
    """The group of tensors vLLM processes together, coarsened to what the names show: a transformer
    layer (all of its modules), else the tensor itself (embeddings, final norm, LM head)."""
    m = re.match(r"(model\.layers\.\d+)\.", name)
    return m.group(1) if m else name


def _retie_embeddings(model, hf_config) -> None:
    """vLLM's layerwise reload (0.32) leaves a tied LM head computing with the old embedding: the head
    gets no tensors of its own, so it keeps its previous tensor and, on CPU, the GEMM handle packed
    from it at load time. Copy the new embedding in and redo the head's post-load processing."""
    if not getattr(hf_config, "tie_word_embeddings", False):
        return
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None:
        raise NotImplementedError(f"weight sync: cannot find the tied lm_head / embed_tokens of {type(model).__name__}")
    if head.weight.data_ptr() != embed.weight.data_ptr():
        head.weight.data.copy_(embed.weight.data)
    head.quant_method.process_weights_after_loading(head)


def _repack_cpu_experts(model) -> int:
    """vLLM 0.32's unquantized MoE method prepacks the experts into the CPU kernel's grouped-GEMM layout
    only the first time its weights are processed; after a reload it copies the new (plain) weights into
    place and skips the prepack, so the CPU kernel reads plain weights as packed ones and every MoE layer
    computes garbage. Redo the CPU experts' own post-load step (pad + prepack) for each MoE layer.
    Returns the number of layers repacked (0 on GPU, whose kernels read the plain weights)."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    repacked = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(module)
            repacked += 1
    return repacked


class _Reload:
    """One weight update into a served model through vLLM's layerwise reload, every tensor checked
    against the served model's own HF config (``vllm_config``) first. The worker extension's ``mr_*``
    methods and ``ShmWeightTransferEngine`` (vLLM's weight-transfer API) both drive one."""

    def __init__(self, model, vllm_config, runner=None):
        from megareason.models.arch import ModelArch
        from megareason.models.weight_map import hf_shapes

        self.model, self.vllm_config, self.runner = model, vllm_config, runner
        hf_config = vllm_config.model_config.hf_config.to_dict()
        self.expected = hf_shapes(ModelArch.from_hf_config(hf_config, source="the served model"))
        self.received: set[str] = set()
        self.pending: dict[str, set[str]] = {}  # unit -> its names not received yet
        for name in self.expected:
            self.pending.setdefault(_unit(name), set()).add(name)

    def begin(self) -> float:
        """Open vLLM's layerwise reload; returns its seconds."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        start = time.perf_counter()
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model)
        return time.perf_counter() - start

    def load_bucket(self, transport: Transport, specs: list[Spec]) -> tuple[int, float]:
        """Load one bucket (see ``rollout.buckets``): ``specs`` lists (name, dtype, shape, byte offset).
        Returns the bucket's size in bytes and the seconds spent in vLLM's ``load_weights``."""
        names, views = read_bucket(transport, specs)
        self.check(names, views)
        # vLLM's layerwise loader holds a tensor until its layer is complete; the trainer refills the
        # bucket next. A layer completed by this bucket is processed (copied into vLLM's own storage)
        # inside load_weights, so its tensors load straight from the bucket; only those of a layer
        # that continues in the next bucket are copied out first.
        tensors = [v.clone() if self.pending[_unit(n)] else v for n, v in zip(names, views, strict=True)]
        return self.load(names, tensors)

    def check(self, names: list[str], tensors: list) -> None:
        for name, t in zip(names, tensors, strict=True):
            want = self.expected.get(name)
            if want is None:
                raise ValueError(f"weight sync: unknown tensor '{name}' (not a weight of the served model)")
            if tuple(t.shape) != want:
                raise ValueError(f"weight sync: tensor '{name}' has shape {tuple(t.shape)}, the served "
                                 f"model expects {want}")
            if name in self.received:
                raise ValueError(f"weight sync: tensor '{name}' sent twice")
            self.received.add(name)
            self.pending[_unit(name)].discard(name)

    def load(self, names: list[str], tensors: list) -> tuple[int, float]:
        from vllm.config import set_current_vllm_config

        start = time.perf_counter()
        with set_current_vllm_config(self.vllm_config):
            self.model.load_weights(zip(names, tensors, strict=True))
        return sum(t.numel() * t.element_size() for t in tensors), time.perf_counter() - start

    def finish(self) -> float:
        """Close the reload (processes layers not processed yet); returns its seconds."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        start = time.perf_counter()
        missing = sorted(set(self.expected) - self.received)
        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(self.model, self.vllm_config.model_config)
            _retie_embeddings(self.model, self.vllm_config.model_config.hf_config)
            _repack_cpu_experts(self.model)
        release_imports()  # the trainer's CUDA-IPC bucket, mapped once for the whole update
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            if self.runner is not None and hasattr(self.runner, reset):
                getattr(self.runner, reset)()
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise ValueError(f"weight sync: {len(missing)} tensors were not sent: {', '.join(missing[:5])}{more}; "
                             f"the layers they belong to kept their old weights")
        return time.perf_counter() - start


class WeightUpdateExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``model_runner``, ``vllm_config``)."""

    def mr_begin_weight_update(self) -> float:
        """Open vLLM's layerwise reload; returns its seconds."""
        self._mr = _Reload(self.model_runner.get_model(), self.vllm_config, self.model_runner)
        return self._mr.begin()

    def mr_load_bucket(self, transport: Transport, specs: list[Spec]) -> tuple[int, float]:
        """Load one bucket; returns (bytes, seconds in vLLM's ``load_weights``)."""
        return self._mr.load_bucket(transport, specs)

    def mr_load_tensors(self, names: list[str], tensors: list) -> tuple[int, float]:
        """In-process callers (``rollout.colocated``, where ``collective_rpc`` is a plain call): load
        these HF-named tensors as they are. The caller must not modify them until the update finishes
        (vLLM may hold a tensor until its layer is complete). Returns (bytes, seconds in vLLM)."""
        self._mr.check(names, tensors)
        return self._mr.load(names, tensors)

    def mr_finish_weight_update(self) -> float:
        """Close the reload (processes layers not processed yet); returns its seconds."""
        return self._mr.finish()


def _register_backends() -> None:
    """``megareason_shm`` and ``megareason_broadcast`` in vLLM's weight-transfer registry (this module is
    imported in every vLLM worker process, as ``worker_extension_cls``, before the worker builds its
    transfer engine)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    for backend, module, engine in ((SHM_BACKEND, "megareason.rollout.transfer", "ShmWeightTransferEngine"),
                                    (BROADCAST_BACKEND, "megareason.rollout.broadcast",
                                     "BroadcastWeightTransferEngine")):
        if backend not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(backend, module, engine)


SHM_BACKEND = "megareason_shm"
BROADCAST_BACKEND = "megareason_broadcast"
_register_backends()
