"""RARO's replay buffer of (question, expert answer, policy answer) triplets.

The critic trains on fresh triplets mixed with historical ones from this buffer, so it does not
forget how earlier policies answered. Two kinds:

- ``fifo``: keeps the last ``capacity`` triplets, oldest first.
- ``reservoir``: a uniform sample of every triplet ever added (Vitter's algorithm R): the i-th
  insertion (0-based) replaces a random slot with probability capacity / (i + 1).

Randomness is a function of (seed, insertion number), never of a hidden generator, so the buffer's
state is its JSON: ``state_dict`` / ``from_state`` round-trip it through a checkpoint exactly.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Literal


@dataclass(frozen=True)
class Triplet:
    """One comparison: the question, the expert's answer, one policy answer (as the critic sees them)."""

    question: str
    expert: str
    policy: str
    data_source: str = ""
    index: int = -1  # the prompt record's index
    step: int = 0  # the training step that produced the policy answer


class ReplayBuffer:
    def __init__(self, capacity: int, kind: Literal["fifo", "reservoir"] = "reservoir", seed: int = 0):
        if capacity < 1:
            raise ValueError(f"replay buffer capacity must be >= 1, got {capacity}")
        if kind not in ("fifo", "reservoir"):
            raise ValueError(f"replay buffer kind must be 'fifo' or 'reservoir', got {kind!r}")
        self.capacity, self.kind, self.seed = capacity, kind, seed
        self.items: list[Triplet] = []
        self.seen = 0  # triplets ever added

    def __len__(self) -> int:
        return len(self.items)

    def add(self, triplets: list[Triplet]) -> None:
        for t in triplets:
            if len(self.items) < self.capacity:
                self.items.append(t)
            elif self.kind == "fifo":
                self.items.pop(0)
                self.items.append(t)
            else:
                j = random.Random(f"{self.seed}:{self.seen}").randrange(self.seen + 1)
                if j < self.capacity:
                    self.items[j] = t
            self.seen += 1

    def sample(self, k: int, seed: int) -> list[Triplet]:
        """min(k, len) distinct triplets, uniformly, determined by ``seed``."""
        return random.Random(seed).sample(self.items, min(k, len(self.items)))

    def state_dict(self) -> dict:
        return {"capacity": self.capacity, "kind": self.kind, "seed": self.seed, "seen": self.seen,
                "items": [asdict(t) for t in self.items]}

    @classmethod
    def from_state(cls, state: dict) -> ReplayBuffer:
        buf = cls(state["capacity"], state["kind"], state["seed"])
        buf.items = [Triplet(**t) for t in state["items"]]
        buf.seen = state["seen"]
        return buf
