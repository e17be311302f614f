"""What the routers of a mixture-of-experts model did during a training step: tokens per expert per
layer and the load-balancing loss, as step metrics.

``RouterWatch`` hooks every megatron-core ``TopKRouter`` of a model. During a training step's forward
passes (not the log-prob passes, not the recomputation inside a backward pass) each hook adds the
tokens its layer sent to each expert, and the switch load-balancing loss of that micro-batch
(Fedus et al. 2021, as megatron-core and transformers define it, before the coefficient):

    aux = E / k * sum_e f_e * P_e,  f_e = tokens routed to e / tokens,  P_e = mean over tokens of softmax(logits)_e

computed from the router's own logits here, so it is logged whether or not the loss trains
(``trainer.moe_aux_loss_coeff`` = 0). transformers' ``load_balancing_loss_func`` is k times this value.
``metrics()`` reduces over the ranks (pipeline stages hold different layers; data-parallel ranks different
tokens; under sequence parallelism each TP rank routes its own slice of the sequence).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class RouterWatch:
    """Forward hooks on the routers of ``model`` (a ``GPTModel``, unwrapped); see the module docstring."""

    def __init__(self, model):
        from megatron.core.transformer.moe.router import TopKRouter

        config = model.config
        self.num_layers, self.num_experts = config.num_layers, config.num_moe_experts
        self.top_k = config.moe_router_topk
        self.sequence_parallel = config.sequence_parallel
        self.counting = False
        self._reset()
        for module in model.modules():
            if isinstance(module, TopKRouter):
                module.register_forward_hook(self._hook)

    def _reset(self) -> None:
        self.tokens = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64)
        self.aux = torch.zeros(self.num_layers, dtype=torch.float64)
        self.passes = torch.zeros(self.num_layers, dtype=torch.float64)

    def start(self) -> None:
        """Count from now on (a training step's forward-backward)."""
        self._reset()
        self.counting = True

    def _hook(self, router, inputs, output) -> None:
        if not self.counting or torch._C._current_graph_task_id() != -1:  # a recomputation inside backward
            return
        with torch.no_grad():
            hidden = inputs[0].reshape(-1, inputs[0].shape[-1]).float()
            routing_map = output[1].reshape(-1, self.num_experts)
            row = router.layer_number - 1
            counts = routing_map.sum(0).double().cpu()
            scores = torch.softmax(hidden @ router.weight.float().t(), dim=-1)
            n = max(hidden.shape[0], 1)
            self.tokens[row] += counts
            self.aux[row] += (self.num_experts / self.top_k) * float((counts.float() / n * scores.mean(0).cpu()).sum())
            self.passes[row] += 1

    def metrics(self) -> dict[str, float]:
        """Stop counting; ``moe/aux_loss`` (mean over layers and micro-batches), ``moe/min_max_ratio``
        (the worst layer's fewest / most tokens of an expert: 1 is perfect balance, 0 an idle expert) and
        per layer ``moe/layer_L/min_max_ratio``, ``moe/layer_L/tokens_max``, ``moe/layer_L/tokens_min``
        (tokens of the most and least used expert, summed over the step). Collective over every rank."""
        from megatron.core import parallel_state as ps

        self.counting = False
        stats = torch.cat([self.tokens.flatten(), self.aux, self.passes])
        device = "cuda" if torch.cuda.is_available() else "cpu"
        packed = stats.to(device)
        groups = [ps.get_pipeline_model_parallel_group(), ps.get_data_parallel_group()]
        if self.sequence_parallel:
            groups.append(ps.get_tensor_model_parallel_group())
        for group in groups:
            if dist.get_world_size(group) > 1:
                dist.all_reduce(packed, group=group)
        packed = packed.cpu()
        layers, experts = self.num_layers, self.num_experts
        tokens = packed[: layers * experts].reshape(layers, experts)
        aux, passes = packed[layers * experts : layers * experts + layers], packed[layers * experts + layers :]
        out = {"moe/aux_loss": float((aux / passes.clamp_min(1)).mean())}
        ratios = []
        for layer in range(layers):
            most, least = float(tokens[layer].max()), float(tokens[layer].min())
            ratio = least / most if most else 1.0
            ratios.append(ratio)
            out[f"moe/layer_{layer}/min_max_ratio"] = ratio
            out[f"moe/layer_{layer}/tokens_max"] = most
            out[f"moe/layer_{layer}/tokens_min"] = least
        out["moe/min_max_ratio"] = min(ratios)
        return out
