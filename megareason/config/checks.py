"""The value checks of a composed config: each failed check is one line naming its field, what was expected
and the value found (``load.py`` reports them together in one ``ConfigError``)."""

from __future__ import annotations

import string
from typing import Any

from megareason.config.schema import Config

# algorithm.policy_loss=gspo: the settings of GSPO's paper (Zheng et al. 2025, arXiv 2507.18071), which
# clips its length-normalised sequence ratio at 3e-4 / 4e-4, and the sequence-level aggregation that
# verl's compute_policy_loss_gspo forces (verl/trainer/ppo/core_algos.py).
GSPO_SETTINGS = {"loss_agg_mode": "seq-mean-token-mean", "clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}



class _Checks:
    """Collects the failed checks of a config, one line each: ``<field> <what>, got <value>``."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def __call__(self, ok: bool, path: str, what: str, value: Any) -> None:
        if not ok:
            self.problems.append(f"{path} {what}, got {value!r}")


def value_problems(cfg: Config) -> list[str]:
    """The value checks every command needs, one line per failed check (empty: all pass)."""
    _check = _Checks()
    r, d = cfg.rollout, cfg.data
    _check(r.n >= 1, "rollout.n", "must be >= 1", r.n)
    _check(r.temperature >= 0, "rollout.temperature", "must be >= 0", r.temperature)
    _check(r.temperature > 0 or r.n == 1, "rollout.n", "must be 1 when rollout.temperature=0", r.n)
    _check(0 < r.top_p <= 1, "rollout.top_p", "must be in (0, 1]", r.top_p)
    _check(r.max_tokens >= 1, "rollout.max_tokens", "must be >= 1", r.max_tokens)
    _check(r.kv_cache_gib > 0, "rollout.kv_cache_gib", "must be > 0", r.kv_cache_gib)
    _check(0 < r.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization", "must be in (0, 1]",
           r.gpu_memory_utilization)
    _check(r.tensor_parallel_size >= 1, "rollout.tensor_parallel_size", "must be >= 1",
           r.tensor_parallel_size)
    _check(d.max_prompt_length >= 1, "data.max_prompt_length", "must be >= 1", d.max_prompt_length)
    _check(
        d.max_prompt_length + r.max_tokens <= r.max_model_len,
        "rollout.max_model_len",
        f"must be >= data.max_prompt_length + rollout.max_tokens = {d.max_prompt_length + r.max_tokens}",
        r.max_model_len,
    )
    _check(bool(d.sources), "data.sources", "must list at least one source", d.sources)
    for i, s in [(f"sources[{i}]", s) for i, s in enumerate(d.sources)] + [
            (f"val_sources[{i}]", s) for i, s in enumerate(d.val_sources)]:
        p = f"data.{i}"
        if s.kind in ("file", "musique"):
            _check(bool(s.path), f"{p}.path", f"is required when kind={s.kind}", s.path)
            _check(s.size >= 0, f"{p}.size", "must be >= 0 (0 keeps every row)", s.size)
        elif s.kind == "synthetic_multihop":
            _check(s.size >= 1, f"{p}.size", "must be >= 1 when kind=synthetic_multihop", s.size)
        elif s.kind == "hf":
            _check(bool(s.name), f"{p}.name", "is required when kind=hf (a data set id such as openai/gsm8k, or a "
                   "local folder)", s.name)
            _check(bool(s.split), f"{p}.split", "is required when kind=hf (e.g. train)", s.split)
            _check(s.size >= 0, f"{p}.size", "must be >= 0 (0 keeps every row)", s.size)
        else:
            _check(bool(s.name), f"{p}.name", "is required when kind=reasoning_gym", s.name)
            _check(s.size >= 1, f"{p}.size", "must be >= 1 when kind=reasoning_gym", s.size)
    e = cfg.env
    _check(e.top_k >= 1, "env.top_k", "must be >= 1", e.top_k)
    _check(e.max_turns >= 1, "env.max_turns", "must be >= 1", e.max_turns)
    _check(e.max_calls_per_turn >= 1, "env.max_calls_per_turn", "must be >= 1", e.max_calls_per_turn)
    _check(e.max_doc_chars >= 1, "env.max_doc_chars", "must be >= 1", e.max_doc_chars)
    for k in cfg.eval.pass_k:
        _check(k >= 1, "eval.pass_k", "entries must be >= 1", cfg.eval.pass_k)
    _check(d.val_size >= 0, "data.val_size", "must be >= 0 (0: no rows held out)", d.val_size)
    _check(0 <= cfg.reward.max_error_rate <= 1, "reward.max_error_rate", "must be in [0, 1] (1: never stop)",
           cfg.reward.max_error_rate)
    _check(not cfg.reward.weights or len(cfg.reward.weights) == len(cfg.reward.funcs), "reward.weights",
           f"must give one weight per reward.funcs entry ({len(cfg.reward.funcs)}), or none (1 each)",
           cfg.reward.weights)
    _check(not (cfg.reward.funcs and cfg.reward.custom), "reward.custom", "and reward.funcs are exclusive: one "
           "function in reward.custom, or several in reward.funcs (summed with reward.weights)", cfg.reward.custom)
    _check(cfg.reward.workers >= 0, "reward.workers", "must be >= 0", cfg.reward.workers)
    _check(cfg.reward.timeout > 0, "reward.timeout", "must be > 0", cfg.reward.timeout)
    v = cfg.reward.tinyv
    _check(v.base_url.startswith(("http://", "https://")), "reward.tinyv.base_url", "must start with http:// "
           "or https://", v.base_url)
    _check(0 <= v.weight <= 1, "reward.tinyv.weight", "must be in [0, 1]", v.weight)
    _check(v.timeout_s > 0, "reward.tinyv.timeout_s", "must be > 0", v.timeout_s)
    _check(v.max_retries >= 0, "reward.tinyv.max_retries", "must be >= 0", v.max_retries)
    _check(v.backoff_s >= 0, "reward.tinyv.backoff_s", "must be >= 0", v.backoff_s)
    _check(v.concurrency >= 1, "reward.tinyv.concurrency", "must be >= 1", v.concurrency)
    _check(v.rrm_max_tokens >= 1, "reward.tinyv.rrm_max_tokens", "must be >= 1", v.rrm_max_tokens)
    _check(not (v.verifier == "rrm" and v.constrain_choices), "reward.tinyv.constrain_choices", "must be false "
           "with reward.tinyv.verifier=rrm (a rubric reward model replies with a graded text, not True/False)",
           v.constrain_choices)
    if v.rrm_template:
        _check_rrm_template(v.rrm_template, _check)
    return _check.problems


def _check_rrm_template(template: str, _check: _Checks) -> None:
    """The grading template must name {criteria} and {solution}, and no placeholder but {question},
    {criteria} and {solution} (other braces are written doubled)."""
    try:
        names = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        names = {f"<{e}>"}
    unknown = sorted(names - {"question", "criteria", "solution"})
    _check(not unknown and {"criteria", "solution"} <= names, "reward.tinyv.rrm_template", "must contain "
           "{criteria} and {solution}, may contain {question}, and no other placeholder (write a literal brace "
           f"doubled: {{{{ }}}}); found {sorted(names)}", template[:200])


def training_problems(cfg: Config) -> list[str]:
    """The checks only training needs, one line per failed check (empty: all pass)."""
    _check = _Checks()
    par, alg, opt, t = cfg.parallel, cfg.algorithm, cfg.optim, cfg.trainer
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size",
                 "expert_model_parallel_size"):
        _check(getattr(par, name) >= 1, f"parallel.{name}", "must be >= 1", getattr(par, name))
    _check(par.data_parallel_size % par.expert_model_parallel_size == 0, "parallel.expert_model_parallel_size",
           f"must divide parallel.data_parallel_size = {par.data_parallel_size} (the experts are split over "
           "data-parallel ranks)", par.expert_model_parallel_size)
    _check(par.expert_model_parallel_size == 1 or par.tensor_model_parallel_size == 1 or par.sequence_parallel,
           "parallel.sequence_parallel", "must be true for an MoE model (expert_model_parallel_size > 1) at "
           "tensor_model_parallel_size > 1: megatron-core trains MoE layers with TP only so", par.sequence_parallel)
    _check(t.moe_aux_loss_coeff >= 0, "trainer.moe_aux_loss_coeff", "must be >= 0 (0: off)", t.moe_aux_loss_coeff)
    _check(t.moe_z_loss_coeff >= 0, "trainer.moe_z_loss_coeff", "must be >= 0 (0: off)", t.moe_z_loss_coeff)
    _check(not par.sequence_parallel or par.tensor_model_parallel_size > 1, "parallel.sequence_parallel",
           "needs parallel.tensor_model_parallel_size > 1", par.sequence_parallel)
    world = par.tensor_model_parallel_size * par.pipeline_model_parallel_size * par.data_parallel_size
    _check(cfg.rollout.placement == "separate" or world % cfg.rollout.tensor_parallel_size == 0,
           "rollout.tensor_parallel_size",
           f"must divide the trainer's world size TP x PP x DP = {world} (each colocated vLLM engine takes that "
           "many consecutive ranks)", cfg.rollout.tensor_parallel_size)
    ro = cfg.rollout
    _check(ro.num_engines >= 1, "rollout.num_engines", "must be >= 1", ro.num_engines)
    _check(ro.placement == "separate" or ro.num_engines == 1, "rollout.num_engines",
           "applies to rollout.placement: separate (colocated engines follow the trainer's ranks)", ro.num_engines)
    _check(t.max_staleness in (0, 1), "trainer.max_staleness",
           "must be 0 (on-policy) or 1 (one step off-policy); larger gaps are not implemented", t.max_staleness)
    if t.max_staleness:
        _check(ro.placement == "separate", "rollout.placement", "must be separate with trainer.max_staleness > 0 "
               "(colocated engines sleep while the trainer trains: nothing can overlap)", ro.placement)
        _check(alg.name != "raro", "trainer.max_staleness", "must be 0 with algorithm.name=raro (the critic round "
               "generates with the weights being trained)", t.max_staleness)
        _check(cfg.env.name == "none", "trainer.max_staleness", "must be 0 with an environment (env.name: "
               "episodes generate turn by turn)", t.max_staleness)
        _check(not alg.dynamic_sampling, "trainer.max_staleness", "must be 0 with algorithm.dynamic_sampling "
               "(it draws more prompts within the step)", t.max_staleness)
    _check(t.recompute_num_layers >= 0, "trainer.recompute_num_layers", "must be >= 0 (0: every layer)",
           t.recompute_num_layers)
    _check(t.steps >= 1, "trainer.steps", "must be >= 1", t.steps)
    _check(t.prompts_per_step >= 1, "trainer.prompts_per_step", "must be >= 1", t.prompts_per_step)
    _check(t.micro_batch_tokens >= cfg.rollout.max_model_len, "trainer.micro_batch_tokens",
           f"must be >= rollout.max_model_len = {cfg.rollout.max_model_len} (a whole sequence fits one "
           "micro-batch)", t.micro_batch_tokens)
    _check(t.save_every >= 0, "trainer.save_every", "must be >= 0", t.save_every)
    _check(t.save_every_minutes >= 0, "trainer.save_every_minutes", "must be >= 0 (0: off)", t.save_every_minutes)
    _check(t.must_save_by_minutes >= 0, "trainer.must_save_by_minutes", "must be >= 0 (0: none)",
           t.must_save_by_minutes)
    _check(t.stop_margin_s >= 0, "trainer.stop_margin_s", "must be >= 0", t.stop_margin_s)
    _check(t.keep_last >= 1, "trainer.keep_last", "must be >= 1", t.keep_last)
    _check(t.val_every >= 0, "trainer.val_every", "must be >= 0", t.val_every)
    _check(t.weight_sync_bucket_mb >= 1, "trainer.weight_sync_bucket_mb", "must be >= 1", t.weight_sync_bucket_mb)
    samples = t.prompts_per_step * cfg.rollout.n
    split = alg.mini_batches * par.data_parallel_size
    _check(samples % split == 0, "trainer.prompts_per_step",
           f"x rollout.n = {samples} samples per step must divide into algorithm.mini_batches x "
           f"parallel.data_parallel_size = {alg.mini_batches} x {par.data_parallel_size} equal shares",
           t.prompts_per_step)
    _check(alg.name != "raro" or cfg.env.name == "none", "env.name",
           "must be none with algorithm.name=raro (RARO judges single-turn answers)", cfg.env.name)
    _check(alg.ppo_epochs >= 1, "algorithm.ppo_epochs", "must be >= 1", alg.ppo_epochs)
    _check(alg.mini_batches >= 1, "algorithm.mini_batches", "must be >= 1", alg.mini_batches)
    _check(0 <= alg.clip_ratio_low < 1, "algorithm.clip_ratio_low", "must be in [0, 1)", alg.clip_ratio_low)
    _check(alg.clip_ratio_high >= 0, "algorithm.clip_ratio_high", "must be >= 0", alg.clip_ratio_high)
    _check(alg.dual_clip == 0 or alg.dual_clip > 1, "algorithm.dual_clip", "must be 0 (off) or > 1", alg.dual_clip)
    _check(alg.value_clip >= 0, "algorithm.value_clip", "must be >= 0", alg.value_clip)
    _check(alg.kl_coef >= 0, "algorithm.kl_coef", "must be >= 0", alg.kl_coef)
    _check(0 <= alg.gamma <= 1, "algorithm.gamma", "must be in [0, 1]", alg.gamma)
    _check(0 <= alg.lam <= 1, "algorithm.lam", "must be in [0, 1]", alg.lam)
    _check(not alg.kl_in_reward or alg.name in ("ppo", "reinforce_pp_baseline"), "algorithm.kl_in_reward",
           "needs algorithm.name=ppo or reinforce_pp_baseline (GRPO takes the KL as a loss term)", alg.kl_in_reward)
    _check(alg.kl_loss_coef == 0 or (alg.kl_loss_coef > 0 and alg.kl_in_reward and alg.kl_coef > 0),
           "algorithm.kl_loss_coef", "is the KL loss term's coefficient beside the KL in the reward: it needs "
           "algorithm.kl_in_reward=true and kl_coef > 0 (without kl_in_reward, kl_coef is the loss term's)",
           alg.kl_loss_coef)
    if alg.policy_loss == "gspo":
        wrong = {k: getattr(alg, k) for k, v in GSPO_SETTINGS.items() if getattr(alg, k) != v}
        if wrong:
            _check.problems.append(
                f"algorithm.policy_loss=gspo needs GSPO's settings: {_settings(GSPO_SETTINGS)} (its paper, "
                "Zheng et al. 2025, clips the length-normalised sequence ratio at 3e-4 / 4e-4, where PPO's 0.2 "
                f"never binds; verl forces that aggregation); got {_settings(wrong)}")
    _check(not alg.dynamic_sampling or alg.name in ("grpo", "reinforce_pp_baseline"), "algorithm.dynamic_sampling",
           "needs algorithm.name=grpo or reinforce_pp_baseline (it filters groups by their rewards)",
           alg.dynamic_sampling)
    _check(alg.dynamic_sampling_max_tries >= 1, "algorithm.dynamic_sampling_max_tries", "must be >= 1",
           alg.dynamic_sampling_max_tries)
    _check(0 <= alg.overlong_buffer <= cfg.rollout.max_tokens, "algorithm.overlong_buffer",
           f"must be in [0, rollout.max_tokens={cfg.rollout.max_tokens}]", alg.overlong_buffer)
    _check(alg.overlong_penalty >= 0, "algorithm.overlong_penalty", "must be >= 0", alg.overlong_penalty)
    for name in ("rollout_tis_cap", "rollout_mis_cap"):
        _check(getattr(alg, name) == 0 or getattr(alg, name) > 1, f"algorithm.{name}", "must be 0 (off) or > 1",
               getattr(alg, name))
    _check(alg.name not in ("grpo", "reinforce_pp_baseline") or cfg.rollout.n >= 2, "rollout.n",
           "must be >= 2 for GRPO and REINFORCE++-baseline (a group needs a baseline)", cfg.rollout.n)
    _check(cfg.rollout.temperature > 0, "rollout.temperature", "must be > 0 for training (on-policy sampling)",
           cfg.rollout.temperature)
    _check(opt.lr > 0, "optim.lr", "must be > 0", opt.lr)
    _check(opt.critic_lr > 0, "optim.critic_lr", "must be > 0", opt.critic_lr)
    _check(opt.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0", opt.warmup_steps)
    lora = cfg.lora
    if lora.enabled:
        _check(lora.rank >= 1, "lora.rank", "must be >= 1", lora.rank)
        _check(lora.alpha > 0, "lora.alpha", "must be > 0", lora.alpha)
        _check(0 <= lora.dropout < 1, "lora.dropout", "must be in [0, 1)", lora.dropout)
        _check(len(set(lora.targets)) == len(lora.targets) >= 1, "lora.targets", "must list distinct targets "
               "(linear_qkv, linear_proj, linear_fc1, linear_fc2), at least one", lora.targets)
    if alg.name == "raro":
        _validate_raro(cfg, _check)
    return _check.problems


def _validate_raro(cfg: Config, _check: _Checks) -> None:
    r = cfg.raro
    _check(cfg.rollout.n >= 2, "rollout.n", "must be >= 2 for RARO (policy groups need a baseline)", cfg.rollout.n)
    _check(r.critic_n >= 2, "raro.critic_n", "must be >= 2 (critic groups need a baseline)", r.critic_n)
    _check(r.critic_max_tokens >= 1, "raro.critic_max_tokens", "must be >= 1", r.critic_max_tokens)
    _check(r.constrain_verdict_chars == 0 or r.critic_max_tokens >= r.constrain_verdict_chars + 8,
           "raro.critic_max_tokens", f"must be >= raro.constrain_verdict_chars + 8 = {r.constrain_verdict_chars + 8} "
           "(room for the reasoning and the verdict line)", r.critic_max_tokens)
    # vLLM's processed log-probs of a constrained verdict are the grammar-masked distribution's (a forced
    # token has log-prob 0 there), not the model's: a rollout correction would weigh those tokens by ~0.
    for name in ("rollout_tis_cap", "rollout_mis_cap"):
        _check(r.constrain_verdict_chars == 0 or getattr(cfg.algorithm, name) == 0, f"algorithm.{name}",
               "must be 0 with raro.constrain_verdict_chars > 0 (the engine's log-probs of a verdict constrained "
               "by a regex are the masked distribution's, not the model's, so the correction would weigh the "
               "critic's verdict tokens by ~0)", getattr(cfg.algorithm, name))
    _check(r.max_response_length >= 0, "raro.max_response_length", "must be >= 0", r.max_response_length)
    _check(r.critic_warmup_steps >= 0, "raro.critic_warmup_steps", "must be >= 0", r.critic_warmup_steps)
    _check(r.critic == "model" or r.critic_warmup_steps == 0, "raro.critic_warmup_steps",
           "must be 0 with raro.critic=answer_equality (no critic model to warm up)", r.critic_warmup_steps)
    _check(0 <= r.replay_buffer_ratio < 1, "raro.replay_buffer_ratio", "must be in [0, 1)", r.replay_buffer_ratio)
    _check(r.replay_buffer_size >= 1, "raro.replay_buffer_size", "must be >= 1", r.replay_buffer_size)
    for name in ("tau_pol", "tau_crit"):
        _check(0 <= getattr(r, name) <= 1, f"raro.{name}", "must be in [0, 1]", getattr(r, name))
    for name in ("lambda_pol", "lambda_crit"):
        _check(getattr(r, name) >= 0, f"raro.{name}", "must be >= 0", getattr(r, name))
    _check(r.lambda_pol + r.lambda_crit > 0, "raro.lambda_crit", "lambda_pol + lambda_crit must be > 0",
           r.lambda_crit)
    _check(r.critic_max_tokens < cfg.rollout.max_model_len, "raro.critic_max_tokens",
           f"must leave room for the critic's prompt in rollout.max_model_len = {cfg.rollout.max_model_len}",
           r.critic_max_tokens)
    if r.expert_template:
        try:
            r.expert_template.format(solution="", answer="")
        except (KeyError, IndexError, ValueError) as e:
            _check.problems.append(f"raro.expert_template {r.expert_template!r}: {e}; it may use {{solution}} and "
                                   "{answer} (write {{ and }} for literal braces)")


def _settings(values: dict[str, Any]) -> str:
    return ", ".join(f"algorithm.{k}={v}" for k, v in values.items())
