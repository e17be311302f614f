"""Which prompts each training step takes: a seeded permutation per epoch, resumable by (epoch, position)."""

from __future__ import annotations

import torch


class PromptSampler:
    """Draws ``k`` prompt indices at a time from a shuffled order of ``size`` items.

    Epoch e's order is ``randperm(size)`` from a generator seeded with ``seed + e``, so the sequence of
    batches depends only on (seed, epoch, position). A batch that reaches the end of an epoch continues
    into the next epoch's order.
    """

    def __init__(self, size: int, seed: int, epoch: int = 0, position: int = 0):
        if size < 1:
            raise ValueError("the training data is empty")
        self.size, self.seed, self.epoch, self.position = size, seed, epoch, position
        self._order = self._permutation(epoch)

    def _permutation(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.size, generator=g).tolist()

    def next(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.position == self.size:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            take = min(k - len(out), self.size - self.position)
            out += self._order[self.position:self.position + take]
            self.position += take
        return out

    def peek(self, k: int) -> list[int]:
        """What ``next(k)`` would return, without drawing it."""
        return PromptSampler(self.size, self.seed, self.epoch, self.position).next(k)
