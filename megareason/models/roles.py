"""The three model roles of RL post-training, built from the same pieces.

* ``Actor``: the policy being trained (DDP + megatron-core optimizer); log-probs and train steps.
* ``Reference``: a frozen copy for the KL term; log-probs only. ``offload()`` moves its weights to CPU
  memory between uses (GPU memory is then free for the actor and vLLM); ``onload()`` brings them back.
* ``Critic``: the same trunk with a scalar value head instead of the LM head (PPO), trained like the
  actor. The trunk starts from the actor's HF checkpoint; the value head starts at zero.

With ``lora`` settings the actor and critic train LoRA adapters on a frozen base (``models/lora.py``;
the critic's value head trains too): DDP and the optimizer hold only the trainable parameters, the
checkpoint records the settings (``megareason.json``: ``lora``), and the weight sync and export read the
merged weights.

Each role lives on every rank of its model-parallel group; the parallel groups must exist
(``parallel.init_parallel``) before a role is built.
"""

from __future__ import annotations

import torch

from megareason.models.build import FP32, ComputeSettings, HFCheckpoint, build_gpt, load_hf_weights
from megareason.models.checkpoint import load_checkpoint, save_checkpoint
from megareason.models.logprobs import logprob_head
from megareason.models.lora import LoRASettings, apply_lora
from megareason.models.moe import RouterWatch
from megareason.models.offload import TrainingStateOffload
from megareason.models.schedule import LossFn, StopCheck, forward_outputs, padded_micro_batches
from megareason.models.train import OptimizerSettings, StepResult, train_step, wrap_for_training


class _Trainable:
    def __init__(self, model, ckpt: HFCheckpoint, settings: OptimizerSettings, lora: LoRASettings | None):
        self.model, self.arch, self.hf_dir, self.lora = model, ckpt.arch, ckpt.dir, lora
        self.ddp, self.optimizer = wrap_for_training(model, settings)
        self.router_watch = RouterWatch(model) if ckpt.arch.is_moe else None
        self.training_state = TrainingStateOffload(self.ddp, self.optimizer)

    def offload_training_state(self) -> None:
        """Gradient buffers and optimizer state to host memory until the next update, save or load."""
        self.training_state.offload()

    def train_step(self, micro_batches, loss_fn: LossFn, stop: StopCheck | None = None) -> StepResult:
        self.training_state.onload()
        return train_step(self.ddp, self.optimizer, micro_batches, self.head, loss_fn, self.router_watch, stop)

    def save(self, path, metadata: dict | None = None, asynchronous: bool = False):
        from dataclasses import asdict

        # the base model's path: a PEFT export names it (adapter_config.json: base_model_name_or_path)
        lora = {"lora": asdict(self.lora), "base_model": str(self.hf_dir)} if self.lora is not None else {}
        # bf16: the model tensors are the optimizer's fp32 main weights rounded (the export reads either).
        precision = {"precision": "bf16" if self.model.config.bf16 else "fp32"}
        # The save needs the optimizer state, not the gradients (the next update zeroes them first): their
        # buffers stay empty through the save's transient (``plan_memory.checkpoint_save_bytes``).
        self.training_state.onload(gradients=False)
        self.training_state.offload(optimizer=False)
        return save_checkpoint(path, self.model, self.arch, self.hf_dir, self.optimizer,
                               {**(metadata or {}), **lora, **precision}, asynchronous=asynchronous)

    def load(self, path) -> dict:
        # The load fills the parameters and the optimizer state; the gradient buffers stay empty (the next
        # update zeroes them first), as in a save.
        self.training_state.onload(gradients=False)
        return load_checkpoint(path, self.model, self.optimizer)


class Actor(_Trainable):
    """``temperature``: the sampling temperature of the rollouts; log-probs are of logits / temperature."""

    def __init__(self, ckpt: HFCheckpoint, settings: OptimizerSettings, compute: ComputeSettings = FP32,
                 temperature: float = 1.0, lora: LoRASettings | None = None):
        model = build_gpt(ckpt.arch, compute, local_spec=lora is not None)
        load_hf_weights(model, ckpt)
        if lora is not None:
            apply_lora(model, lora)
        super().__init__(model, ckpt, settings, lora)
        self.head = logprob_head(ckpt.arch.vocab_size, temperature)

    def logprobs(self, tokens_BT: torch.Tensor, micro_batch_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """(``logp_BT``, ``entropy_BT``) of right-padded rows; see ``logprobs.logprob_head``."""
        outs = forward_outputs(self.model, padded_micro_batches(tokens_BT, micro_batch_size), self.head, 2)
        return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])

    def logprobs_of(self, micro_batches) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(``logp_BT``, ``entropy_BT``) of each micro-batch (padded or packed ``TokenBatch``)."""
        return [(o[0], o[1]) for o in forward_outputs(self.model, micro_batches, self.head, 2)]


class Reference:
    """The frozen policy of the KL term, built from the same HF checkpoint as the actor: log-probs only,
    no optimizer, never saved. ``temperature`` as ``Actor``'s. Every rank of its model-parallel group
    builds it and makes the same calls."""

    def __init__(self, ckpt: HFCheckpoint, compute: ComputeSettings = FP32, temperature: float = 1.0):
        self.model = build_gpt(ckpt.arch, compute)
        load_hf_weights(self.model, ckpt)
        self.model.requires_grad_(False)
        self.model.eval()
        self.head = logprob_head(ckpt.arch.vocab_size, temperature)
        self._device = next(self.model.parameters()).device

    def logprobs(self, tokens_BT: torch.Tensor, micro_batch_size: int = 1) -> torch.Tensor:
        """``logp_BT`` (float32, CPU, the same on every rank) of right-padded rows, ``micro_batch_size``
        rows per micro-batch (B must be a multiple); see ``logprobs.logprob_head``. A collective over the
        model-parallel group. ``RuntimeError`` while offloaded (GPU machines)."""
        if next(self.model.parameters()).device != self._device:
            raise RuntimeError("reference weights are offloaded; call onload() first")
        outs = forward_outputs(self.model, padded_micro_batches(tokens_BT, micro_batch_size), self.head, 2)
        return torch.cat([o[0] for o in outs])

    def offload(self) -> None:
        """Move the weights to (pinned, on GPU machines) CPU memory."""
        for p in self.model.parameters():
            p.data = p.data.to("cpu", non_blocking=True)
            if torch.cuda.is_available():
                p.data = p.data.pin_memory()

    def onload(self) -> None:
        """Move the weights back to the device they were built on (asynchronous copies; no-op on CPU)."""
        for p in self.model.parameters():
            p.data = p.data.to(self._device, non_blocking=True)


class ValueHead(torch.nn.Module):
    """hidden [S, B, H] -> values [S, B, 1] in float32 (its weights too, whatever the model's precision),
    in place of GPTModel's output layer (same call signature).

    Replicated over tensor-parallel ranks: its input is complete on every rank, or (``sequence_parallel``)
    gathered first from the ranks' slices of the sequence.
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype = torch.float32, device: torch.device | None = None,
                 sequence_parallel: bool = False):
        super().__init__()
        self.sequence_parallel = sequence_parallel
        # Named like GPTModel's output layer ("output_layer.weight"), which megatron-core's
        # sharded_state_dict expects to find on the last stage of an untied model.
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device))

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        """``(values [S, B, 1] float32, None)`` as GPTModel's output layer returns ``(logits, bias)``;
        ``weight`` and ``runtime_gather_output`` are ignored."""
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            # Every rank computes the same values and loss, so each keeps its own slice of the gradient.
            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden_states.float(), self.weight, self.bias), None


def value_head_outputs(values: torch.Tensor, batch) -> tuple[torch.Tensor]:
    """GPTModel returns [B, T, 1] from the value head; column t is the value after reading token t."""
    return (values[..., 0].float(),)


class Critic(_Trainable):
    """PPO's value model: the actor's trunk from the same HF checkpoint, untied, with a zero-initialised
    float32 ``ValueHead`` on the last stage; trained, saved and loaded like the actor."""

    def __init__(self, ckpt: HFCheckpoint, settings: OptimizerSettings, compute: ComputeSettings = FP32,
                 lora: LoRASettings | None = None):
        from dataclasses import replace

        from megareason.models.parallel import current_layout

        # The trunk loads like the actor's; an untied build keeps the value head off the embedding.
        model = build_gpt(replace(ckpt.arch, tie_word_embeddings=False), compute, local_spec=lora is not None)
        load_hf_weights(model, ckpt, with_output_layer=False)
        if lora is not None:
            apply_lora(model, lora)  # freezes the trunk; the value head below trains in full
        if current_layout().last_stage:
            device = next(model.parameters()).device
            model.output_layer = ValueHead(ckpt.arch.hidden_size, torch.float32, device,
                                           sequence_parallel=model.config.sequence_parallel)
        super().__init__(model, ckpt, settings, lora)
        self.head = value_head_outputs

    def values(self, tokens_BT: torch.Tensor, micro_batch_size: int = 1) -> torch.Tensor:
        """``values_BT`` (float32, CPU, the same on every rank): column t is the value after reading token
        t. Right-padded rows, B a multiple of ``micro_batch_size``; a collective over the model-parallel group."""
        outs = forward_outputs(self.model, padded_micro_batches(tokens_BT, micro_batch_size), self.head, 1)
        return torch.cat([o[0] for o in outs])
