"""One step off-policy rollouts (``trainer.max_staleness: 1``, on a separate pool: ``trainer.pool``).

Step k of the loop, with ``OneStepOff`` as its rollout variant::

    wait for batch k (started during step k-1)  -> time/generate_wait
    push the weights of step k-1 into the idle engines  -> time/sync
    start batch k+1 on the engines (returns at once)
    score batch k, log-probs, train step k       (the engines generate batch k+1 meanwhile)

so batch k+1 is generated with the weights of step k-1 and trained on by step k+1: one version behind
(``rollout/staleness`` = 1; the first batch: 0). The steady-state step takes refit + max(generation,
scoring + log-probs + training): the engines cannot generate while their weights are replaced. The
loss's rollout correction (``algorithm.rollout_tis_cap`` / ``rollout_mis_cap``) weighs the gap: the
old log-probs are the trainer's, the rollout log-probs the engines'.

Validation first settles (``before_validation``: waits for the batch in flight, pushes the newest weights),
so it scores the step's weights; that changes no sample. A checkpoint saves the batch in flight with the step
(``rollout_inflight.pt``: its completions, prompt indices and policy version) and a resumed run trains on
it instead of generating it again: the weights it was generated with are not in the checkpoint, so
regenerating would change the run. Resumed, the losses are those of the run that was not stopped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from megareason.config import Config
from megareason.data.records import TokenizedPrompt
from megareason.rollout.records import Completion
from megareason.trainer.driver import timed
from megareason.trainer.handles import PolicyHandle
from megareason.trainer.pool import PendingGeneration
from megareason.trainer.steps import RolloutVariant, SingleTurn, StepRows, sampling

INFLIGHT = "rollout_inflight.pt"
log = logging.getLogger(__name__)


@dataclass
class Batch:
    """A step's generation: in flight (``pending``) or done (``completions``)."""

    step: int
    indices: list[int]  # the step's prompts (indices into the training prompts)
    version: int  # the policy version (steps trained) of the weights it was generated with
    pending: PendingGeneration | None = None
    completions: list[list[Completion]] | None = None
    engine_s: float = 0.0  # the slowest engine's generation seconds

    def wait(self) -> list[list[Completion]]:
        if self.completions is None:
            self.completions, self.engine_s = self.pending.result()
            self.pending = None
        return self.completions


class OneStepOff(RolloutVariant):
    """``SingleTurn``'s rows from batches generated one step ahead (module docstring). ``upcoming(n)``: the
    indices of the next step's n prompts, not drawn yet (the prompt sampler's ``peek``); ``start_step`` and
    ``resumed_from``: the step and checkpoint folder the run resumed from (0 and None: a fresh run)."""

    pushes_weights = True  # before each batch is launched, while the engines are idle

    def __init__(self, cfg: Config, policy: SingleTurn, actors: PolicyHandle, prompts: list[TokenizedPrompt],
                 upcoming: Callable[[int], list[int]], start_step: int, resumed_from: Path | None,
                 resume_syncs: Sequence = ()):
        if actors.pool is None:
            raise ValueError("one step off-policy rollouts need a separate rollout pool")
        self.cfg, self.policy, self.actors, self.prompts, self.upcoming = cfg, policy, actors, prompts, upcoming
        # The driver pushed the weights of the step resumed from into the engines (or they hold the
        # initial ones): both sides are at that version. The uninterrupted run pushed them in the next step,
        # before its batch (``_push``): that step reports the resume's push (``resume_syncs``), so a resumed
        # run's metrics are the uninterrupted run's.
        self.version = self.engine_version = start_step
        self.next: Batch | None = None
        self.syncs: list = list(resume_syncs)
        if resumed_from is not None and (resumed_from / INFLIGHT).is_file():
            self.next = load_inflight(resumed_from / INFLIGHT)
            log.info("resuming with the batch of step %d saved in flight (generated with the weights of step %d)",
                     self.next.step, self.next.version)

    def state(self) -> dict:
        return self.policy.state()

    def __call__(self, step: int, batch: list[TokenizedPrompt], timer: dict[str, float]) -> StepRows:
        self.version = step - 1  # the trainer's weights: steps trained so far
        current, self.next = self.next, None
        if current is not None and (current.step != step or not self._same_prompts(current, batch)):
            log.warning("the saved batch in flight (step %d) is not step %d's prompts: generating them again",
                        current.step, step)
            current = None
        if current is None:  # the first step (or resumed without a batch in flight): generate it now
            self._push(timer)
            current = self._launch(step, [], batch)
        with timed(timer, "generate_wait"):
            completions = current.wait()
        self._push(timer)  # the engines are idle: the newest weights, for the next batch
        if step < self.cfg.trainer.steps:
            indices = self.upcoming(self.cfg.trainer.prompts_per_step)
            self.next = self._launch(step + 1, indices, [self.prompts[i] for i in indices])
        with timed(timer, "reward"):
            scored = self.policy.score_fn(batch, completions)
        rows = self.policy._rows(batch, completions, scored)
        syncs, self.syncs = self.syncs, []
        return replace(rows, sync=syncs, metrics={
            **rows.metrics, "rollout/policy_version": current.version,
            "rollout/staleness": self.version - current.version, "time/engine_generate": current.engine_s})

    def before_validation(self, step: int) -> None:
        """After step ``step``'s update: the batch in flight done and the engines on the newest weights
        (validation scores them)."""
        self.version = step
        if self.next is not None:
            self.next.wait()
        self._push({})

    def save_files(self, folder: Path) -> None:
        """The batch in flight, waited for (``INFLIGHT``), into the checkpoint's folder."""
        if self.next is None:
            return
        b = self.next
        b.wait()
        torch.save({"step": b.step, "indices": b.indices, "version": b.version, "engine_s": b.engine_s,
                    "completions": [[asdict(c) for c in group] for group in b.completions]}, folder / INFLIGHT)

    def _launch(self, step: int, indices: list[int], batch: list[TokenizedPrompt]) -> Batch:
        pending = self.actors.pool.generate_async([p.token_ids for p in batch], sampling(self.cfg, step))
        return Batch(step=step, indices=indices, version=self.engine_version, pending=pending)

    def _push(self, timer: dict[str, float]) -> None:
        if self.engine_version < self.version:
            with timed(timer, "sync"):
                self.syncs += self.actors.sync_weights()
            self.engine_version = self.version

    def _same_prompts(self, saved: Batch, batch: list[TokenizedPrompt]) -> bool:
        return [self.prompts[i].token_ids for i in saved.indices] == [p.token_ids for p in batch]


def load_inflight(path: Path) -> Batch:
    """The batch a checkpoint saved in flight (``OneStepOff.save``)."""
    d = torch.load(path, weights_only=True)
    return Batch(step=d["step"], indices=d["indices"], version=d["version"], engine_s=d["engine_s"],
                 completions=[[Completion(**c) for c in group] for group in d["completions"]])
