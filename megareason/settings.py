"""Config -> settings: every adapter from the typed config to the settings a lower layer takes.

The engine, the Megatron roles and the environments take small frozen ``*Settings`` records that know
nothing of ``Config`` and declare no defaults; each default lives once, in ``config/schema.py``, and
reaches them through these functions. The trainer, ``megareason eval`` and the tools build their
settings here, never field by field at the call site.
"""

from __future__ import annotations

from dataclasses import replace

from megareason.config.schema import Config, DataConfig, RolloutConfig
from megareason.envs.retrieval_qa import SYSTEM_PROMPT, RetrievalQASettings
from megareason.models.build import ComputeSettings
from megareason.models.hub import resolve_model_path
from megareason.models.lora import LoRASettings
from megareason.models.train import OptimizerSettings
from megareason.raro.prompts import POLICY_SYSTEM_PROMPT
from megareason.rollout.records import EngineSettings, Sampling


def engine_settings(cfg: Config) -> EngineSettings:
    """The vLLM engine of ``model.path`` with the ``rollout.*`` engine settings. vLLM gets local folders: a
    Hub id is read from the Hugging Face cache, where the command's checks fetched it before any engine."""
    return _engine(cfg.rollout, str(resolve_model_path(cfg.model.path, download=False)),
                   str(resolve_model_path(cfg.model.tokenizer, download=False)) if cfg.model.tokenizer else "")


def one_engine_settings(model: str, max_model_len: int, rollout: RolloutConfig | None = None) -> EngineSettings:
    """One engine of one rank on ``model`` (an HF folder, a known model name or a Hub id) with ``rollout``'s
    engine settings (the schema's defaults if None) at ``max_model_len``: what the tools that score a
    checkpoint outside a run start."""
    r = replace(rollout or RolloutConfig(), max_model_len=max_model_len, tensor_parallel_size=1)
    return _engine(r, str(resolve_model_path(model)), "")


def _engine(r: RolloutConfig, model_path: str, tokenizer: str) -> EngineSettings:
    return EngineSettings(
        model_path=model_path,
        tokenizer=tokenizer,
        dtype=r.dtype,
        max_model_len=r.max_model_len,
        kv_cache_gib=r.kv_cache_gib,
        gpu_memory_utilization=r.gpu_memory_utilization,
        tensor_parallel_size=r.tensor_parallel_size,
        enforce_eager=r.enforce_eager,
        model_runner=r.model_runner,
        seed=r.seed,
        extra={},
    )


def sampling_from(cfg: Config) -> Sampling:
    """The policy's sampling: ``rollout.n`` samples per prompt at ``rollout.temperature``."""
    r = cfg.rollout
    return Sampling(n=r.n, temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens,
                    stop=tuple(r.stop))


def optimizer_settings(cfg: Config, lr: float) -> OptimizerSettings:
    """``optim.*`` at learning rate ``lr`` (the actor's ``optim.lr`` or the critic's ``optim.critic_lr``,
    either after the warm-up schedule)."""
    o = cfg.optim
    return OptimizerSettings(lr=lr, weight_decay=o.weight_decay, beta1=o.beta1, beta2=o.beta2, eps=o.eps,
                             clip_grad=o.clip_grad, use_distributed_optimizer=o.use_distributed_optimizer)


def compute_settings(cfg: Config) -> ComputeSettings:
    """Precision, activation recomputation and sequence parallelism of every Megatron role."""
    t = cfg.trainer
    return ComputeSettings(precision=t.precision, recompute=t.recompute, recompute_num_layers=t.recompute_num_layers,
                           sequence_parallel=cfg.parallel.sequence_parallel, moe_aux_loss_coeff=t.moe_aux_loss_coeff,
                           moe_z_loss_coeff=t.moe_z_loss_coeff)


def lora_settings(cfg: Config) -> LoRASettings | None:
    """The adapters of the trained roles, or None (full fine-tuning)."""
    lo = cfg.lora
    if not lo.enabled:
        return None
    return LoRASettings(rank=lo.rank, alpha=lo.alpha, dropout=lo.dropout, seed=cfg.trainer.seed,
                        targets=tuple(lo.targets))


def retrieval_qa_settings(cfg: Config) -> RetrievalQASettings:
    """The ``env.*`` settings of the retrieval QA environment (``env.system_prompt`` empty: the built-in one)."""
    e = cfg.env
    return RetrievalQASettings(retriever=e.retriever, top_k=e.top_k, max_calls_per_turn=e.max_calls_per_turn,
                               max_doc_chars=e.max_doc_chars, system_prompt=e.system_prompt or SYSTEM_PROMPT,
                               initial_search=e.initial_search)


def policy_data(cfg: Config) -> DataConfig:
    """``cfg.data`` with RARO's policy system prompt in place of ``data.system_prompt`` when
    algorithm.name is raro (training, and evaluating a RARO policy as it was trained)."""
    if cfg.algorithm.name != "raro":
        return cfg.data
    return replace(cfg.data, system_prompt=cfg.raro.policy_system_prompt or POLICY_SYSTEM_PROMPT)
