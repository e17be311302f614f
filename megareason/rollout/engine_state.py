"""The rollout engine's sleep/wake state machine (colocated with Megatron on GPU).

On GPU the rollout engine shares each device with Megatron: it sleeps while Megatron computes and wakes
for the weight sync and for generation. vLLM 0.32's ``sleep`` pauses its scheduler, so a ``generate``
on a sleeping engine queues requests that are never scheduled and blocks forever; and a level-2 sleep
discards the weights, so waking without a sync would generate from garbage. ``EngineStateMachine`` owns
the transitions for any engine with ``generate`` / ``update_weights`` / ``sleep(level)`` /
``wake_up(tags)`` (``VLLMEngine``, an SPMD engine), so no caller can reach either case:

    state           weights                  KV cache   generate                     update_weights
    AWAKE           on the device (current)  allocated  runs                         in place
    ASLEEP_WEIGHTS  host memory (level 1)    freed      wakes everything, then runs  wakes weights, loads, wakes KV
    ASLEEP_ALL      discarded (level 2)      freed      refused: sync first          wakes weights, loads, wakes KV
    SYNCING         being overwritten        either     (not reachable)              (in progress)
    STALE           a mix (a sync failed)    either     refused: sync again          loads, wakes KV if asleep
    FAILED          unknown (sleep or wake raised)      refused                      refused

Every wake-up first empties this process's CUDA caching allocator (``torch.cuda.empty_cache``): blocks
Megatron freed (activations, an offloaded reference) stay cached otherwise, and vLLM's allocations
come from the device, not from this process's cache. On CPU vLLM has no sleep mode (the engine's
``sleep``/``wake_up`` are no-ops) but the state machine runs all the same, and ``events`` records every
call it made, which is what the tests check.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

log = logging.getLogger(__name__)


class EngineState(enum.Enum):
    """Where the engine's weights and KV cache are, and so which calls it allows (the module docstring's table)."""

    AWAKE = "awake"
    ASLEEP_WEIGHTS = "asleep_weights"  # level 1: weights in host memory, KV cache freed
    ASLEEP_ALL = "asleep_all"  # level 2: weights and KV cache discarded
    SYNCING = "syncing"
    STALE = "stale"  # a sync failed part-way: resident weights are a mix of old and new
    FAILED = "failed"


@dataclass(frozen=True)
class Event:
    """One call the state machine made: ``kind`` is generate, update_weights, sleep, wake_up or
    empty_cache; ``detail`` the level or tags; ``state`` the state when the call was made."""

    kind: str
    detail: str
    state: EngineState


class SleepableEngine(Protocol):
    """What ``EngineStateMachine`` drives (``VLLMEngine``, ``ColocatedEngine``): the raw calls, which do
    not check the engine's state themselves; see ``VLLMEngine`` for what each does."""

    tokenizer: object

    def generate(self, prompts_token_ids: Sequence[list[int]], sampling, use_tqdm: bool = True) -> list: ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int):
        """Load HF-named tensors in place; a failure part-way leaves a mix of old and new weights."""
        ...

    def sleep(self, level: int) -> None:
        """Level 1: weights to host memory; level 2: weights discarded. Both free the KV cache."""
        ...

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo ``sleep`` for ``tags`` ("weights", "kv_cache"; None: everything)."""
        ...

    def shutdown(self) -> None: ...


def empty_cuda_cache() -> None:
    """``torch.cuda.empty_cache()`` when CUDA is available (the default ``empty_cache`` before a wake-up)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class EngineStateError(RuntimeError):
    """A call the engine's state does not allow (it would hang, or generate from discarded weights)."""


class EngineStateMachine:
    """See the module docstring. ``empty_cache`` frees this process's device memory before each wake-up:
    the trainer's worker also moves its optimizer state to host memory there (``trainer.offload_optimizer``);
    tests replace it to record the phase."""

    def __init__(self, engine: SleepableEngine, empty_cache: Callable[[], None] = empty_cuda_cache):
        self.engine, self._empty_cache = engine, empty_cache
        self.tokenizer = engine.tokenizer
        self.state = EngineState.AWAKE
        self._kv_asleep = False  # SYNCING / STALE: whether the KV cache is still to be woken
        self.events: list[Event] = []

    def generate(self, prompts_token_ids: Sequence[list[int]], sampling, use_tqdm: bool = True) -> list:
        """Wakes the engine if it slept with its weights kept (level 1); refuses discarded or stale weights."""
        if self.state is EngineState.ASLEEP_WEIGHTS:
            self._wake(None)
            self.state = EngineState.AWAKE
        if self.state is not EngineState.AWAKE:
            raise EngineStateError(self._refusal("generate"))
        self._record("generate", "")
        return self.engine.generate(prompts_token_ids, sampling, use_tqdm=use_tqdm)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int):
        """Wakes the weights (not yet the KV cache, so both copies of the weights never sit beside a KV
        cache on the device), loads, then wakes the KV cache. A failed load leaves the engine STALE."""
        if self.state is EngineState.FAILED:
            raise EngineStateError(self._refusal("update_weights"))
        if self.state in (EngineState.ASLEEP_WEIGHTS, EngineState.ASLEEP_ALL):
            self._wake(["weights"])
            self._kv_asleep = True
        elif self.state is EngineState.AWAKE:
            self._kv_asleep = False
        self.state = EngineState.SYNCING
        self._record("update_weights", "")
        try:
            update = self.engine.update_weights(named_tensors, bucket_bytes)
        except BaseException:
            self.state = EngineState.STALE
            raise
        if self._kv_asleep:
            self._wake(["kv_cache"])
            self._kv_asleep = False
        self.state = EngineState.AWAKE
        return update

    def sleep(self, level: int) -> None:
        """Free the device for Megatron. Level 2 discards the weights (the caller syncs before the next
        generate: the training step's case), level 1 keeps them in host memory. A sleeping engine
        stays as it is."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self.state in (EngineState.ASLEEP_WEIGHTS, EngineState.ASLEEP_ALL):
            return
        if self.state is EngineState.FAILED:
            raise EngineStateError(self._refusal("sleep"))
        if self.state is EngineState.STALE:
            level = 2  # nothing worth keeping
            if self._kv_asleep:  # vLLM sleeps only a fully awake engine
                self._wake(["kv_cache"])
                self._kv_asleep = False
        self._record("sleep", str(level))
        self._guarded(lambda: self.engine.sleep(level))
        self.state = EngineState.ASLEEP_WEIGHTS if level == 1 else EngineState.ASLEEP_ALL

    def wake_up(self) -> None:
        """Wake a level-1 sleep (weights and KV cache); after a level-2 sleep only a sync can."""
        if self.state is EngineState.ASLEEP_WEIGHTS:
            self._wake(None)
            self.state = EngineState.AWAKE
        elif self.state is not EngineState.AWAKE:
            raise EngineStateError(self._refusal("wake_up"))

    def shutdown(self) -> None:
        """Shut the engine down whatever its state (the state machine is not told: do not use it after)."""
        self.engine.shutdown()

    def _wake(self, tags: list[str] | None) -> None:
        self._record("empty_cache", "")
        self._empty_cache()
        self._record("wake_up", "all" if tags is None else ",".join(tags))
        self._guarded(lambda: self.engine.wake_up(tags))

    def _guarded(self, call: Callable[[], None]) -> None:
        """A sleep or wake-up that raised leaves the device memory in an unknown state: FAILED."""
        try:
            call()
        except BaseException:
            self.state = EngineState.FAILED
            raise

    def _record(self, kind: str, detail: str) -> None:
        self.events.append(Event(kind, detail, self.state))

    def _refusal(self, call: str) -> str:
        why = {
            EngineState.ASLEEP_ALL: "its weights were discarded by a level-2 sleep; sync weights first",
            EngineState.STALE: "a weight sync failed part-way and its weights are a mix of old and new; "
                               "sync again first",
            EngineState.FAILED: "a sleep or wake-up failed and its device memory is in an unknown state; "
                                "restart the engine",
            EngineState.SYNCING: "a weight sync is in progress",
        }.get(self.state, "")
        return f"rollout engine: cannot {call} in state {self.state.value}: {why}"
