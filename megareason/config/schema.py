"""The typed configuration: every default lives here, exactly once.

YAML files in ``configs/`` and command-line overrides only change these values; code reads the
dataclasses, never ``cfg.get(key, default)``. ``load.py`` turns a composed hydra config into these
objects and reports unknown keys and wrong types with the dotted path of the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class ModelConfig:
    """Which weights to load.

    ``path`` is either a name from ``megareason models list`` (provisioned offline into the cache by
    ``megareason models fetch NAME``) or a local directory holding an HF checkpoint.
    """

    path: str = "smollm2-135m-instruct"
    # Tokenizer directory; empty means the model directory.
    tokenizer: str = ""


@dataclass
class DataSourceConfig:
    """One source of prompts.

    ``kind`` is ``file`` (``path`` names a local JSON/JSONL/Parquet file) or ``reasoning_gym``
    (``name`` is a reasoning-gym generator such as ``basic_arithmetic``; ``size`` items from ``seed``,
    generator options from ``options``). ``size`` 0 keeps every row of a file.
    """

    kind: Literal["file", "reasoning_gym"] = "reasoning_gym"
    name: str = ""
    path: str = ""
    size: int = 0
    seed: int = 0
    options: dict[str, int | float | str | bool | list[int | float | str]] = field(default_factory=dict)
    # Overrides the data_source of every row (selects the reward function); empty keeps the rows'.
    data_source: str = ""


@dataclass
class DataConfig:
    sources: list[DataSourceConfig] = field(default_factory=list)
    # System prompt put before every question; empty means none.
    system_prompt: str = (
        "You are a helpful assistant. Think step by step, then give the final answer "
        "inside \\boxed{}."
    )
    # Prompts longer than this (in tokens, after the chat template) are filtered or rejected.
    max_prompt_length: int = 512
    truncation: Literal["filter", "error"] = "filter"


@dataclass
class RolloutConfig:
    """Sampling settings and the vLLM engine's settings."""

    n: int = 4
    temperature: float = 0.7
    top_p: float = 1.0
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    seed: int = 0
    # Engine.
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    max_model_len: int = 1024
    kv_cache_gib: float = 1.0  # CPU only: VLLM_CPU_KVCACHE_SPACE
    gpu_memory_utilization: float = 0.5  # GPU only
    tensor_parallel_size: int = 1
    enforce_eager: bool = True


@dataclass
class EvalConfig:
    output_dir: str = "outputs/eval"
    # pass@k is reported for each k here that is <= rollout.n.
    pass_k: list[int] = field(default_factory=lambda: [1, 4])


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
