"""Config: every YAML loads, overrides apply, bad input gets an error naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from megareason.config import CONFIG_DIR, Config, ConfigError, from_dict, load_config, validate_training
from megareason.config.schema import RolloutConfig

ALL_CONFIGS = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
SOURCE = {"kind": "reasoning_gym", "name": "basic_arithmetic", "size": 4}


def test_there_are_configs():
    assert "eval" in ALL_CONFIGS


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_every_yaml_loads(name):
    cfg = load_config(name)
    assert isinstance(cfg, Config) and cfg.data.sources
    if not name.startswith("eval"):  # the training recipes also pass the training checks
        validate_training(cfg)


def test_defaults_come_from_the_schema_and_yaml_overrides_them():
    cfg = load_config("eval")
    assert cfg.rollout.top_p == RolloutConfig().top_p  # not in eval.yaml
    assert cfg.rollout.max_model_len == 640  # set in eval.yaml
    assert cfg.data.sources[0].options["max_terms"] == 2


def test_command_line_overrides():
    cfg = load_config("eval", ["rollout.temperature=0.9", "data.max_prompt_length=128", "rollout.top_p=1"])
    assert cfg.rollout.temperature == 0.9
    assert cfg.data.max_prompt_length == 128
    assert cfg.rollout.top_p == 1.0 and isinstance(cfg.rollout.top_p, float)


def test_sources_override_as_a_list():
    cfg = load_config("eval", ["data.sources=[{kind: file, path: a.jsonl, data_source: math}]"])
    (src,) = cfg.data.sources
    assert (src.kind, src.path, src.data_source, src.size) == ("file", "a.jsonl", "math", 0)


def test_unknown_override_key_lists_valid_keys():
    with pytest.raises(ConfigError) as e:
        load_config("eval", ["rollout.temperatur=0.5"])
    msg = str(e.value)
    assert "rollout.temperatur" in msg and "temperature" in msg and "top_p" in msg


def test_unknown_top_level_key():
    with pytest.raises(ConfigError, match="unknown key 'trainr'.*valid keys of the config: algorithm, benchmark, data"):
        load_config("eval", ["trainr.steps=3"])


def test_wrong_type_names_field_and_expected_type():
    with pytest.raises(ConfigError, match=r"rollout\.n: expected int, got str 'many'"):
        load_config("eval", ["rollout.n=many"])
    with pytest.raises(ConfigError, match=r"rollout\.enforce_eager: expected bool"):
        load_config("eval", ["rollout.enforce_eager=3"])


def test_literal_field():
    with pytest.raises(ConfigError, match=r"data\.truncation: expected one of \['filter', 'error'\]"):
        load_config("eval", ["data.truncation=cut"])


def test_unknown_key_in_yaml_file(tmp_path: Path):
    (tmp_path / "bad.yaml").write_text(
        "defaults:\n  - megareason_defaults\n  - _self_\n"
        "data:\n  sources:\n    - {kind: reasoning_gym, name: countdown, size: 2, sead: 1}\n"
    )
    with pytest.raises(ConfigError, match=r"unknown key 'data\.sources\[0\]\.sead'.*seed"):
        load_config("bad", config_dir=tmp_path)


def test_missing_config_name_lists_available():
    with pytest.raises(ConfigError, match="no config 'nope'.*eval"):
        load_config("nope")


@pytest.mark.parametrize(
    "patch, field",
    [
        ({"rollout": {"n": 0}}, "rollout.n"),
        ({"rollout": {"top_p": 1.5}}, "rollout.top_p"),
        ({"rollout": {"temperature": 0.0, "n": 4}}, "rollout.n"),
        ({"rollout": {"max_model_len": 100}}, "rollout.max_model_len"),
        ({"data": {"sources": []}}, "data.sources"),
        ({"data": {"sources": [{"kind": "file"}]}}, r"data.sources\[0\].path"),
        ({"data": {"sources": [{"kind": "reasoning_gym", "name": "countdown"}]}}, r"data.sources\[0\].size"),
    ],
)
def test_value_checks_name_the_field(patch, field):
    raw = {"data": {"sources": [SOURCE]}}
    for section, values in patch.items():
        raw.setdefault(section, {}).update(values)
    with pytest.raises(ConfigError, match=field):
        from_dict(raw)


def test_ints_accepted_for_floats_but_bools_not_for_ints():
    cfg = from_dict({"data": {"sources": [SOURCE]}, "rollout": {"temperature": 1}})
    assert cfg.rollout.temperature == 1.0
    with pytest.raises(ConfigError, match="rollout.max_tokens: expected int, got bool"):
        from_dict({"data": {"sources": [SOURCE]}, "rollout": {"max_tokens": True}})


@pytest.mark.parametrize("override, message", [
    ("lora.rank=0", "lora.rank must be >= 1"),
    ("lora.dropout=1.0", r"lora.dropout must be in \[0, 1\)"),
    ("lora.targets=[linear_qkv,linear_qkv]", "lora.targets must list distinct targets"),
    ("lora.targets=[]", "lora.targets must list distinct targets"),
    ("lora.targets=[q_proj]", r"lora.targets\[0\]: expected one of"),
])
def test_lora_settings_are_checked(override, message):
    with pytest.raises(ConfigError, match=message):
        validate_training(load_config("grpo_smollm2_cpu", ["lora.enabled=true", override]))


@pytest.mark.parametrize("overrides, message", [
    (["trainer.max_staleness=2"], r"trainer.max_staleness must be 0 \(on-policy\) or 1"),
    (["trainer.max_staleness=1"], "rollout.placement must be separate with trainer.max_staleness > 0"),
    (["rollout.num_engines=2"], "rollout.num_engines applies to rollout.placement: separate"),
    (["rollout.placement=separate", "rollout.num_engines=0"], "rollout.num_engines must be >= 1"),
    (["rollout.placement=separate", "trainer.max_staleness=1", "algorithm.name=raro"],
     "trainer.max_staleness must be 0 with algorithm.name=raro"),
    (["rollout.placement=separate", "trainer.max_staleness=1", "algorithm.dynamic_sampling=true"],
     "trainer.max_staleness must be 0 with algorithm.dynamic_sampling"),
    (["rollout.placement=separate", "trainer.max_staleness=1", "env.name=retrieval_qa"],
     "trainer.max_staleness must be 0 with an environment"),
])
def test_placement_and_staleness_are_checked(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate_training(load_config("grpo_smollm2_cpu", overrides))
    # the same run without the offending value is valid
    validate_training(load_config("grpo_smollm2_cpu", ["rollout.placement=separate", "trainer.max_staleness=1"]))


@pytest.mark.parametrize("cap", ["rollout_tis_cap", "rollout_mis_cap"])
def test_a_rollout_correction_is_refused_with_a_constrained_critic_verdict(cap):
    with pytest.raises(ConfigError, match=f"algorithm.{cap} must be 0 with raro.constrain_verdict_chars > 0"):
        validate_training(load_config("compare_smollm2_cpu", ["algorithm.name=raro", f"algorithm.{cap}=2.0"]))
    validate_training(load_config("compare_smollm2_cpu", ["algorithm.name=raro", f"algorithm.{cap}=2.0",
                                                          "raro.constrain_verdict_chars=0"]))
    validate_training(load_config("raro_70b"))  # the GPU recipe corrects and lets its critic write freely


def test_a_separate_pool_must_fit_beside_the_trainer():
    from megareason.trainer.pool import _engine_cores, check_pool

    cfg = load_config("grpo_smollm2_cpu", ["rollout.placement=separate", "rollout.num_engines=2"])
    check_pool(cfg, cpus=0, gpus=10, world=8, on_gpu=True)  # 8 + 2 x 1 = 10 GPUs
    with pytest.raises(ConfigError, match=r"8 GPUs \+ rollout.num_engines 2 x rollout.tensor_parallel_size 1 = 10 "
                                          "GPUs, but the Ray cluster has 9"):
        check_pool(cfg, cpus=0, gpus=9, world=8, on_gpu=True)
    check_pool(cfg, cpus=3, gpus=0, world=1, on_gpu=False)  # one CPU per engine on CPU
    with pytest.raises(ConfigError, match="need 3 CPUs"):
        check_pool(cfg, cpus=2, gpus=0, world=1, on_gpu=False)
    # engines take the last cores, the trainer the first ones
    assert _engine_cores([0, 1, 2, 3], 0, 1) == [3] and _engine_cores([0, 1, 2, 3], 1, 1) == [2]
    assert _engine_cores([0, 1, 2, 3, 4, 5], 0, 2) == [4, 5]


def test_broadcast_engines_go_on_nodes_without_the_trainers_ranks_when_the_cluster_has_several():
    """NeMo-RL's split of a non-colocated job: training nodes and generation nodes (Ray's label selector on the
    engines' bundles); one node, or the tmpfs transfer (the trainer's node only), selects nothing."""
    from megareason.trainer.pool import engine_nodes

    def node(name: str, gpus: int, alive: bool = True) -> dict:
        return {"NodeID": name, "Alive": alive, "Resources": {"CPU": 128.0, "GPU": float(gpus)}}

    gpu = {"GPU": 1, "CPU": 1}
    cfg = load_config("grpo_llama8b_async")  # 8 engines of TP 1 by broadcast, the trainer on 8 GPUs
    two = [node("a", 8), node("b", 8), node("gone", 8, alive=False)]
    assert engine_nodes(cfg, gpu, frozenset({"a"}), two) == {"ray.io/node-id": "!in(a)"}
    assert engine_nodes(cfg, gpu, frozenset({"a"}), two[:1]) == {}  # one node: beside the trainer
    shm = load_config("grpo_llama8b_async", ["rollout.weight_transfer=shm"])
    assert engine_nodes(shm, gpu, frozenset({"a"}), two) == {}
    tp2 = load_config("grpo_llama8b_async", ["rollout.num_engines=4", "rollout.tensor_parallel_size=2"])
    assert engine_nodes(tp2, gpu, frozenset({"a"}), two) == {"ray.io/node-id": "!in(a)"}  # 4 x 2 on b's 8
    with pytest.raises(ConfigError, match=r"rollout.num_engines=8 engines of rollout.tensor_parallel_size=1 GPUs "
                                          r"each go on the nodes without the trainer's ranks, which hold 6"):
        engine_nodes(cfg, gpu, frozenset({"a"}), [node("a", 8), node("b", 6)])
    # a trainer across both nodes leaves none (the dead node counts for nothing)
    with pytest.raises(ConfigError, match="which hold 0"):
        engine_nodes(cfg, gpu, frozenset({"a", "b"}), two)
    cpu = load_config("grpo_smollm2_cpu", ["rollout.placement=separate", "rollout.num_engines=2",
                                           "rollout.tensor_parallel_size=2", "rollout.weight_transfer=broadcast"])
    assert engine_nodes(cpu, {"CPU": 1}, frozenset({"b"}), [node("a", 0), node("b", 0)]) == {"ray.io/node-id": "!in(b)"}


def test_a_replaced_key_is_refused_naming_the_keys_that_replace_it(tmp_path: Path):
    message = (r"'algorithm.kl_kind' is not a key: set algorithm.kl_reward_kind \(the KL subtracted from the "
               r"reward, kl_in_reward\) and algorithm.kl_loss_kind \(the KL loss term\) instead")
    for override in ("algorithm.kl_kind=k3", "+algorithm.kl_kind=k3"):
        with pytest.raises(ConfigError, match=message):
            load_config("eval", [override])
    (tmp_path / "old.yaml").write_text("defaults:\n  - megareason_defaults\n  - _self_\n"
                                       "algorithm:\n  kl_kind: low_var_kl\n")
    with pytest.raises(ConfigError, match=message):
        load_config("old", config_dir=tmp_path)
    cfg = load_config("eval", ["algorithm.kl_reward_kind=k2", "algorithm.kl_loss_kind=k1"])
    assert (cfg.algorithm.kl_reward_kind, cfg.algorithm.kl_loss_kind) == ("k2", "k1")


GSPO_PAPER = ["algorithm.policy_loss=gspo", "algorithm.loss_agg_mode=seq-mean-token-mean",
              "algorithm.clip_ratio_low=3e-4", "algorithm.clip_ratio_high=4e-4"]


def test_gspo_is_held_to_its_papers_clip_range_and_sequence_level_aggregation():
    paper = ("algorithm.policy_loss=gspo needs GSPO's settings: algorithm.loss_agg_mode=seq-mean-token-mean, "
             "algorithm.clip_ratio_low=0.0003, algorithm.clip_ratio_high=0.0004 (its paper")
    with pytest.raises(ConfigError) as e:
        validate_training(load_config("grpo_smollm2_cpu", ["algorithm.policy_loss=gspo"]))
    assert str(e.value).startswith(paper), str(e.value)
    assert str(e.value).endswith("got algorithm.loss_agg_mode=token-mean, algorithm.clip_ratio_low=0.2, "
                                 "algorithm.clip_ratio_high=0.2")
    cfg = load_config("grpo_smollm2_cpu", GSPO_PAPER)
    validate_training(cfg)
    assert (cfg.algorithm.clip_ratio_low, cfg.algorithm.clip_ratio_high) == (3e-4, 4e-4)
    with pytest.raises(ConfigError, match=r"needs GSPO's settings: .* got algorithm.clip_ratio_high=0.28$"):
        validate_training(load_config("grpo_smollm2_cpu", [*GSPO_PAPER, "algorithm.clip_ratio_high=0.28"]))
    validate_training(load_config("grpo_smollm2_cpu", ["algorithm.clip_ratio_high=0.28"]))  # PPO's loss: any


def test_a_yaml_anywhere_inherits_a_bundled_recipe(tmp_path: Path):
    mine = tmp_path / "exp" / "mine.yaml"
    mine.parent.mkdir()
    mine.write_text("defaults:\n  - grpo_quickstart\n  - _self_\ntrainer:\n  steps: 2\n  output_dir: runs/mine\n")
    recipe = load_config("grpo_quickstart")
    for cfg in (load_config(str(mine), ["rollout.n=8"], training=True),
                load_config("mine", ["rollout.n=8"], config_dir=mine.parent)):
        assert (cfg.trainer.steps, cfg.trainer.output_dir, cfg.rollout.n) == (2, "runs/mine", 8)
        assert cfg.data == recipe.data and cfg.model == recipe.model  # the rest is the recipe's
    with pytest.raises(ConfigError, match="no config file .*nope.yaml"):
        load_config(str(tmp_path / "nope.yaml"))


def test_a_misspelt_recipe_in_a_defaults_list_names_the_nearest(tmp_path: Path):
    (tmp_path / "mine.yaml").write_text("defaults:\n  - grpo_quickstrt\n  - _self_\n")
    with pytest.raises(ConfigError, match=r"'grpo_quickstrt'.*did you mean 'grpo_quickstart'\?"):
        load_config(str(tmp_path / "mine.yaml"))
    with pytest.raises(ConfigError, match=r"no config 'grpo_quickstrat'.*did you mean 'grpo_quickstart'\?"):
        load_config("grpo_quickstrat")


def test_every_problem_of_a_run_is_reported_at_once_with_the_nearest_key(tmp_path: Path):
    (tmp_path / "mine.yaml").write_text(
        "defaults:\n  - grpo_quickstart\n  - _self_\ntrainer:\n  stesp: 3\n"
        "data:\n  sources:\n    - {kind: reasoning_gym, name: countdown, size: 2, sead: 1}\n")
    overrides = ["trainer.save_evry=2", "rollout.n=many", "algorithm.name=grop", "rollout.top_p=2",
                 "optim.lr=0"]
    with pytest.raises(ConfigError) as e:
        load_config(str(tmp_path / "mine.yaml"), overrides, training=True)
    lines = str(e.value).split("\nerror: ")
    expected = [
        "unknown key 'trainer.save_evry' in override 'trainer.save_evry=2' (did you mean 'trainer.save_every'?)",
        "unknown key 'trainer.stesp' (did you mean 'trainer.steps'?)",
        "unknown key 'data.sources[0].sead' (did you mean 'data.sources[0].seed'?)",
        "rollout.n: expected int, got str 'many'",
        "algorithm.name: expected one of ['grpo', 'ppo', 'raro', 'reinforce_pp_baseline'], got str 'grop' "
        "(did you mean 'grpo'?)",
        "rollout.top_p must be in (0, 1], got 2.0",
        "optim.lr must be > 0, got 0.0",  # a training check, reported with the others
    ]
    for want in expected:
        assert sum(line.startswith(want) for line in lines) == 1, (want, lines)
    assert len(lines) == len(expected)
    assert e.value.problems == lines


def test_a_key_with_nothing_near_lists_the_valid_keys_only():
    with pytest.raises(ConfigError) as e:
        load_config("eval", ["rollout.zzzzzz=1"])
    assert "did you mean" not in str(e.value) and "valid keys of rollout: " in str(e.value)


def test_the_cli_prints_every_problem_once(capsys):
    from megareason.cli import main

    assert main(["train", "trainer.stpes=3", "rollout.top_p=2", "--show-config"]) == 2
    err = capsys.readouterr().err
    assert "error: unknown key 'trainer.stpes' in override 'trainer.stpes=3' (did you mean 'trainer.steps'?)" in err
    assert "\nerror: rollout.top_p must be in (0, 1], got 2.0" in err


def test_a_mapping_field_takes_new_keys_from_a_plain_override():
    """hydra's struct mode refuses new keys in a mapping unless the override says `+`/`++`; a user writes
    `reward.by_source={src: f.py}` as for any other field."""
    cfg = load_config("grpo_quickstart", ["reward.by_source={mine: /x/a.py, theirs: /x/b.py:fn}",
                                          "reward.by_source.third=/x/c.py"])
    assert cfg.reward.by_source == {"mine": "/x/a.py", "theirs": "/x/b.py:fn", "third": "/x/c.py"}
