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
tokens; under sequence parallelism each TP rank routes its own slice of a micro-batch, and the loss is that
of the whole micro-batch, as megatron-core computes it over the TP group).
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
        # per layer, per forward pass: tokens per expert, summed router probabilities per expert, tokens
        self.passes: dict[int, list[torch.Tensor]] = {}

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
            scores = torch.softmax(hidden @ router.weight.float().t(), dim=-1)
            stats = torch.cat([routing_map.sum(0).double(), scores.sum(0).double(),
                               torch.tensor([hidden.shape[0]], dtype=torch.float64, device=scores.device)])
            self.passes.setdefault(router.layer_number - 1, []).append(stats.cpu())

    def metrics(self) -> dict[str, float]:
        """Stop counting; ``moe/aux_loss`` (mean over layers and micro-batches), ``moe/min_max_ratio``
        (the worst layer's fewest / most tokens of an expert: 1 is perfect balance, 0 an idle expert) and
        per layer ``moe/layer_L/min_max_ratio``, ``moe/layer_L/tokens_max``, ``moe/layer_L/tokens_min``
        (tokens of the most and least used expert, summed over the step). Collective over every rank."""
        from megatron.core import parallel_state as ps

        self.counting = False
        layers, experts = self.num_layers, self.num_experts
        device = "cuda" if torch.cuda.is_available() else "cpu"
        # Every layer of a stage sees the same micro-batches; under sequence parallelism each TP rank routes
        # its slice of each micro-batch, so the TP ranks' statistics of one pass add up to the micro-batch's.
        num_passes = max((len(v) for v in self.passes.values()), default=0)
        per_pass = torch.zeros(layers, num_passes, 2 * experts + 1, dtype=torch.float64)
        for layer, stats in self.passes.items():
            per_pass[layer, : len(stats)] = torch.stack(stats)
        if self.sequence_parallel and num_passes:
            per_pass = per_pass.to(device)
            dist.all_reduce(per_pass, group=ps.get_tensor_model_parallel_group())
            per_pass = per_pass.cpu()
        tokens, probs, n = per_pass[..., :experts], per_pass[..., experts:-1], per_pass[..., -1:]
        ran = n[..., 0] > 0
        aux_per_pass = (self.num_experts / self.top_k) * ((tokens / n.clamp_min(1)) * (probs / n.clamp_min(1))).sum(-1)
        packed = torch.cat([tokens.sum(1).flatten(), (aux_per_pass * ran).sum(1), ran.sum(1).double()]).to(device)
        for group in (ps.get_pipeline_model_parallel_group(), ps.get_data_parallel_group()):
            if dist.get_world_size(group) > 1:  # stages hold different layers, DP ranks different tokens
                dist.all_reduce(packed, group=group)
        packed = packed.cpu()
        counts = packed[: layers * experts].reshape(layers, experts)
        aux, runs = packed[layers * experts : layers * experts + layers], packed[layers * experts + layers :]
        out = {"moe/aux_loss": float((aux / runs.clamp_min(1)).mean())}
        ratios = []
        for layer in range(layers):
            most, least = float(counts[layer].max()), float(counts[layer].min())
            ratio = least / most if most else 1.0
            ratios.append(ratio)
            out[f"moe/layer_{layer}/min_max_ratio"] = ratio
            out[f"moe/layer_{layer}/tokens_max"] = most
            out[f"moe/layer_{layer}/tokens_min"] = least
        out["moe/min_max_ratio"] = min(ratios)
        return out
