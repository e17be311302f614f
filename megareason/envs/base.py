"""The environment interface: what a multi-turn rollout (``envs.rollout``) needs from a task.

An environment is one episode. ``reset`` gives the opening chat messages; ``step`` takes the model's
message and answers with an observation (the next ``tool`` message) or ends the episode with its
reward. When the rollout ends an episode itself (the turn limit, or no room left in the context for
the observation and another turn) it calls ``finish``: the environment always scores its episodes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class StepResult:
    observation: str = ""  # the tool message's content (read when not done)
    reward: float = 0.0  # the episode's reward (read when done)
    done: bool = False
    correct: bool = False  # for accuracy metrics (read when done)
    info: dict[str, Any] = field(default_factory=dict)  # JSON-safe details for dumps and tables


class Environment(Protocol):
    tools: Sequence[Callable]  # described to the model (``envs.tools``)

    def reset(self) -> list[dict[str, str]]:
        """The episode's opening chat messages (system prompt included)."""
        ...

    def step(self, message: str) -> StepResult:
        """React to the model's message."""
        ...

    def finish(self) -> StepResult:
        """The rollout ended the episode after the last ``step`` (its observation unseen): score it."""
        ...
