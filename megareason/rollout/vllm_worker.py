"""A vLLM worker extension that takes new weights in place, bucket by bucket.

vLLM loads it into each of its workers (``LLM(worker_extension_cls=...)``) and the engine calls its
methods through ``LLM.collective_rpc``. One update is ``mr_begin_weight_update``, then
``mr_load_weight_bucket`` per bucket, then ``mr_finish_weight_update`` (prefixed: vLLM's worker has
methods with the plain names for its own GPU transfer engines). vLLM's layerwise reload is opened
once, each bucket's HF-named tensors go through the model's own ``load_weights`` (a layer is
processed as soon as all its tensors have arrived, so buckets need not align with layers), and the
reload is closed at the end: vLLM's ``reload_weights`` split across calls, so the weights never need
to be in one process at once.

Every tensor is checked against the served model's own HF config first: an unknown name, a wrong
shape or a missing tensor fails loudly with the name (and both shapes), never loads silently.
"""

from __future__ import annotations


class WeightUpdateExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``model_runner``, ``vllm_config``)."""

    def _expected_shapes(self) -> dict[str, tuple[int, ...]]:
        from megareason.models.arch import ModelArch
        from megareason.models.weight_map import hf_shapes

        hf_config = self.vllm_config.model_config.hf_config.to_dict()
        return hf_shapes(ModelArch.from_hf_config(hf_config, source="the served model"))

    def mr_begin_weight_update(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        self._mr_expected = self._expected_shapes()
        self._mr_received: set[str] = set()
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model_runner.get_model())

    def mr_load_weight_bucket(self, payload: bytes) -> int:
        """Load one bucket, serialised with ``safetensors.torch.save`` (vLLM's RPC turns raw tensors
        into nested lists); returns its size in bytes."""
        from safetensors.torch import load
        from vllm.config import set_current_vllm_config

        bucket = load(payload)
        names, tensors = list(bucket), list(bucket.values())
        for name, t in zip(names, tensors, strict=True):
            want = self._mr_expected.get(name)
            if want is None:
                raise ValueError(f"weight sync: unknown tensor '{name}' (not a weight of the served model)")
            if tuple(t.shape) != want:
                raise ValueError(f"weight sync: tensor '{name}' has shape {tuple(t.shape)}, the served "
                                 f"model expects {want}")
            if name in self._mr_received:
                raise ValueError(f"weight sync: tensor '{name}' sent twice")
            self._mr_received.add(name)
        with set_current_vllm_config(self.vllm_config):
            self.model_runner.get_model().load_weights(zip(names, tensors, strict=True))
        return sum(t.numel() * t.element_size() for t in tensors)

    def mr_finish_weight_update(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        missing = sorted(set(self._mr_expected) - self._mr_received)
        runner = self.model_runner
        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(runner.get_model(), self.vllm_config.model_config)
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            if hasattr(runner, reset):
                getattr(runner, reset)()
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise ValueError(f"weight sync: {len(missing)} tensors were not sent: {', '.join(missing[:5])}{more}; "
                             f"the layers they belong to kept their old weights")
