"""PPO's critic ranks: one process per rank of the critic role, driven like the policy's (``workers.py``)."""

from __future__ import annotations

import torch

from megareason.models.memory import record_phases
from megareason.trainer.experience import Experience
from megareason.trainer.stats import CriticStats
from megareason.trainer.workers import _Worker


class CriticWorker(_Worker):
    """One rank of PPO's critic: the policy's trunk with a scalar value head."""

    def _build(self) -> None:
        """The critic; with ``trainer.offload_optimizer`` its gradient buffers and optimizer state wait in host
        memory from the start (its process holds no engine to wake: they leave after each load, update and save)."""
        self.role = self.critic = self._new_critic()
        self._offload()

    def _new_critic(self):
        from megareason.models.build import HFCheckpoint
        from megareason.models.hub import resolve_model_path
        from megareason.models.roles import Critic

        s = self.settings
        return Critic(HFCheckpoint(resolve_model_path(s.model_path, download=False)), s.optimizer, s.compute,
                      lora=s.lora)

    def _offload(self) -> None:
        if self.settings.offload_optimizer:
            self.critic.offload_training_state()

    def load(self, path: str) -> dict:
        metadata = self.role.load(path)
        self._offload()
        return metadata

    def save(self, path: str, metadata: dict, asynchronous: bool = False) -> None:
        self._write_checkpoint(path, metadata, asynchronous)  # an asynchronous save has copied the state by now
        self._offload()

    def values(self, exp: Experience) -> torch.Tensor:
        """[B_share, T]: column t is the value of the state before token t."""
        from megareason.trainer.losses import shift_values

        (values,) = self._outputs(self.critic.model, self.critic.head, 1, exp)
        return shift_values(values)

    def train(self, exp: Experience, lr: float) -> CriticStats:
        """One optimizer step of the value loss over this replica's share of ``exp`` (a mini-batch)."""
        from megareason.trainer.losses import value_loss_fn

        stats = self._train(self.critic, exp, ["mask_BT", "values_BT", "returns_BT"],
                            value_loss_fn(self.settings.algorithm, self.settings.max_tokens), lr, CriticStats)
        self._offload()
        return stats


record_phases({CriticWorker: {"values": "logprobs", "train": "training", "save": "save", "load": "resume"}})
