"""Compose a config with hydra from ``configs/`` (or a user's YAML anywhere) and turn it into the typed
dataclasses.

Hydra does the composition (defaults lists, ``key=value`` overrides). A YAML outside ``configs/`` may
inherit a bundled recipe by naming it in its defaults list (``defaults: [grpo_quickstart, _self_]``): the
bundled folder is on hydra's search path after the YAML's own folder.

The conversion is strict and reports every problem of a config at once (one ``ConfigError`` listing
them): an unknown key names the nearest valid key and the valid keys, a wrong type names the field and
the expected type, and value checks name the field and the allowed range.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

from megareason.config.checks import training_problems, value_problems
from megareason.config.schema import Config

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
log = logging.getLogger(__name__)


DEFAULTS_NODE = "megareason_defaults"

# Keys that do not exist, with the keys that do their work: a config or override that sets one is refused
# naming them (instead of a bare "unknown key").
REPLACED_KEYS = {
    "algorithm.kl_kind": "algorithm.kl_reward_kind (the KL subtracted from the reward, kl_in_reward) and "
                         "algorithm.kl_loss_kind (the KL loss term)",
}

# Other projects' keys (verl's Hydra config, TRL's GRPOConfig) a user brings, with the keys that do their
# work here: a config or override that sets one is refused naming ours. Looked up by the whole key, then
# by its leading parts (``actor_rollout_ref.anything``).
FOREIGN_KEYS = {
    "custom_reward_function": ("verl", "reward.custom=path/to/file.py:function"),
    "custom_reward_function.path": ("verl", "reward.custom=path/to/file.py:function (path and name in one)"),
    "custom_reward_function.name": ("verl", "reward.custom=path/to/file.py:function (path and name in one)"),
    "data.train_files": ("verl", "data.sources=[{kind: file, path: train.parquet}] (or {kind: hf, name: a/b})"),
    "data.val_files": ("verl", "data.val_sources=[{kind: file, path: test.parquet}]"),
    "data.prompt_key": ("verl", "data.sources[].columns={your_column: prompt}"),
    "data.train_batch_size": ("verl", "trainer.prompts_per_step"),
    "data.max_response_length": ("verl", "rollout.max_tokens"),
    "actor_rollout_ref": ("verl", "model.*, rollout.*, optim.*, algorithm.* (docs/from_verl.md maps them)"),
    "actor_rollout_ref.model.path": ("verl", "model.path"),
    "actor_rollout_ref.rollout.n": ("verl", "rollout.n"),
    "actor_rollout_ref.rollout.temperature": ("verl", "rollout.temperature"),
    "actor_rollout_ref.actor.optim.lr": ("verl", "optim.lr"),
    "actor_rollout_ref.actor.kl_loss_coef": ("verl", "algorithm.kl_coef"),
    "actor_rollout_ref.actor.ppo_mini_batch_size": ("verl", "algorithm.mini_batches (how many, not their size)"),
    "algorithm.adv_estimator": ("verl", "algorithm.name (grpo, ppo, reinforce_pp_baseline, raro)"),
    "trainer.total_training_steps": ("verl", "trainer.steps"),
    "trainer.total_epochs": ("verl", "trainer.steps"),
    "trainer.default_local_dir": ("verl", "trainer.output_dir"),
    "trainer.logger": ("verl", "trainer.loggers"),
    "reward_funcs": ("TRL", "reward.funcs=[a.py:f, b.py:g] (or reward.custom=a.py:f for one)"),
    "reward_weights": ("TRL", "reward.weights=[1.0, 0.5]"),
    "num_generations": ("TRL", "rollout.n"),
    "max_completion_length": ("TRL", "rollout.max_tokens"),
    "max_prompt_length": ("TRL", "data.max_prompt_length"),
    "learning_rate": ("TRL", "optim.lr"),
    "beta": ("TRL", "algorithm.kl_coef"),
    "max_steps": ("TRL", "trainer.steps"),
    "model_name_or_path": ("TRL", "model.path"),
    "dataset_name": ("TRL", "data.sources=[{kind: hf, name: a/b}]"),
    "output_dir": ("TRL", "trainer.output_dir"),
    "temperature": ("TRL", "rollout.temperature"),
    "per_device_train_batch_size": ("TRL", "trainer.prompts_per_step (prompts; x rollout.n samples per step)"),
}


def _foreign(key: str) -> str | None:
    """The message for another project's key (``FOREIGN_KEYS``), or None."""
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        found = FOREIGN_KEYS.get(".".join(parts[:n]))
        if found:
            return f"unknown key '{key}': that is {found[0]}'s; here set {found[1]}"
    return None


class ConfigError(ValueError):
    """A user error in a config file or override: one problem or several (``problems``), each naming its
    field; the message lists them all, one per line."""

    def __init__(self, problems: str | list[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\nerror: ".join(self.problems))


def _nearest(word: str, choices: typing.Iterable[str]) -> str | None:
    """The choice closest to ``word`` (difflib's ratio >= 0.6), if any."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return close[0] if close else None


def _unknown_key(key: str, part: str, names: typing.Iterable[str], where: str, suffix: str = "") -> str:
    """``unknown key 'a.b'[ in override ...]; did you mean 'a.c'? valid keys of a: ...``."""
    names = list(names)
    near = _nearest(part, names)
    hint = f" (did you mean '{key[: len(key) - len(part)]}{near}'?)" if near else ""
    return f"unknown key '{key}'{suffix}{hint}; valid keys of {where}: {', '.join(names)}"


def _override_problems(override: str) -> list[str]:
    """What is wrong with the key of a ``key=value`` override: not a schema field (naming the nearest one
    and the valid keys) or a replaced key; empty when it is fine."""
    key = override.split("=", 1)[0].lstrip("+~")
    if key in REPLACED_KEYS:
        return [_replaced(key)]
    if (foreign := _foreign(key)) and not _is_field(key):
        return [foreign]
    cls: Any = Config
    parts = key.split(".")
    for depth, part in enumerate(parts):
        names = sorted(f.name for f in dataclasses.fields(cls))
        if part not in names:
            where = ".".join(parts[:depth]) or "the config"
            return [_unknown_key(".".join(parts[: depth + 1]), part, names, where, f" in override '{override}'")]
        cls = typing.get_type_hints(cls)[part]
        if not dataclasses.is_dataclass(cls):
            break  # lists and mappings: their items are checked after composition
    return []


def _is_field(key: str) -> bool:
    """Whether dotted ``key`` names a field of the schema (or lies inside a list or mapping field)."""
    cls: Any = Config
    for part in key.split("."):
        if not dataclasses.is_dataclass(cls):
            return True
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return False
        cls = hints[part]
    return True


def _in_mapping(override: str) -> bool:
    """A plain ``key=value`` that sets a mapping field (e.g. ``reward.by_source={a: f.py}``) or one of its
    entries: hydra's struct mode would refuse the mapping's new keys, so it is applied as ``++key=value``."""
    if override.startswith(("+", "~")):
        return False
    cls: Any = Config
    for part in override.split("=", 1)[0].split("."):
        if not dataclasses.is_dataclass(cls):
            return False
        cls = typing.get_type_hints(cls).get(part)
        if typing.get_origin(cls) is dict:
            return True
    return False


def resolve_config_path(name: str, config_dir: str | Path | None = None) -> tuple[str, Path]:
    """``(config name, its folder)`` for a ``--config-name``: a bundled recipe's name, a name in
    ``config_dir``, or the path of a YAML file anywhere (``my/exp.yaml``: name ``exp`` in ``my/``)."""
    if name.endswith((".yaml", ".yml")):
        path = Path(name).expanduser()
        if not path.is_absolute() and config_dir is not None and not path.is_file():
            path = Path(config_dir) / path
        if not path.is_file():
            raise ConfigError(f"no config file {path}")
        if path.suffix != ".yaml":
            raise ConfigError(f"config file {path}: hydra reads .yaml files only; rename it to {path.stem}.yaml")
        return path.stem, path.resolve().parent
    return name, Path(config_dir or CONFIG_DIR).resolve()


def load_config(
    name: str = "eval", overrides: list[str] | None = None, config_dir: str | Path | None = None,
    training: bool = False,
) -> Config:
    """Compose ``<config_dir>/<name>.yaml`` (``name`` may also be a YAML file's path) with ``overrides``
    and return a validated :class:`Config` (with ``training``, also ``validate_training``'s checks).
    Every problem found is reported in one ``ConfigError``."""
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.errors import HydraException, MissingConfigException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    name, config_dir = resolve_config_path(name, config_dir)
    folders = [config_dir] + ([CONFIG_DIR] if config_dir != CONFIG_DIR.resolve() else [])
    available = sorted({p.stem for d in folders for p in d.glob("*.yaml")})
    if not any((d / f"{name}.yaml").is_file() for d in folders):
        near = _nearest(name, available)
        hint = f" (did you mean '{near}'?)" if near else ""
        raise ConfigError(f"no config '{name}' in {' or '.join(map(str, folders))}{hint}; available: "
                          f"{', '.join(available)}")
    problems: list[str] = []
    kept = []
    for override in overrides or []:
        found = _override_problems(override)
        problems += found
        if not found:
            kept.append(f"++{override}" if _in_mapping(override) else override)
    # Every recipe starts its defaults list with this node: all schema fields exist before the YAML
    # and the overrides are applied, so `key=value` works for fields the YAML does not mention.
    ConfigStore.instance().store(name=DEFAULTS_NODE, node=OmegaConf.create(dataclasses.asdict(Config())))
    # A YAML outside configs/ finds the bundled recipes after its own folder's files.
    search = [f"hydra.searchpath=[file://{CONFIG_DIR.resolve()}]"] if len(folders) > 1 else []
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base=None):
            composed = compose(config_name=name, overrides=search + kept)
        raw = OmegaConf.to_container(composed, resolve=True)
    except MissingConfigException as e:
        missing = re.search(r"Could not (?:find|load) '([^']+)'", str(e))
        near = _nearest(missing.group(1), available + [DEFAULTS_NODE]) if missing else None
        hint = f" (did you mean '{near}'?)" if near else ""
        raise ConfigError(problems + [f"config '{name}' in {config_dir}: {str(e).splitlines()[0]}{hint}; a defaults "
                                      f"list names {DEFAULTS_NODE} or one of: {', '.join(available)}"]) from e
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(problems + [f"config '{name}' with overrides {kept}: {e}"]) from e
    own_yaml = config_dir / f"{name}.yaml" if config_dir != CONFIG_DIR.resolve() else None
    _validation_follows_the_data(raw, overrides or [], own_yaml)
    return from_dict(raw, training, problems)


def _validation_follows_the_data(raw: dict[str, Any], overrides: list[str], own_yaml: Path | None) -> None:
    """A recipe's ``data.val_sources`` are its data's held-out questions: when the user replaces
    ``data.sources`` (an override, or a YAML of their own that inherits the recipe) without naming
    ``data.val_sources``, they are dropped: validation is then ``data.val_size`` rows held out of the
    user's data, or none; never the recipe's questions scored as the user's."""
    from omegaconf import OmegaConf

    keys = [o.split("=", 1)[0].lstrip("+~") for o in overrides]
    replaced = "data.sources" in keys
    named = any(k.startswith("data.val_sources") for k in keys)
    if own_yaml is not None and own_yaml.is_file():
        mine = OmegaConf.to_container(OmegaConf.load(own_yaml)) or {}
        data = mine.get("data") if isinstance(mine, dict) else None
        if isinstance(data, dict):
            replaced = replaced or "sources" in data
            named = named or "val_sources" in data
    data = raw.get("data")
    if replaced and not named and isinstance(data, dict) and data.get("val_sources"):
        # the start-up table (rewards/data_table.py) says what validation is, before any worker starts
        log.debug("data.sources replaces the recipe's data: its data.val_sources (%d source(s)) are dropped",
                  len(data["val_sources"]))
        data["val_sources"] = []


def from_dict(raw: dict[str, Any], training: bool = False, problems: list[str] | None = None) -> Config:
    """The :class:`Config` of a composed mapping, checked by ``validate`` (and with ``training``,
    ``validate_training``); ``problems`` found before (the overrides') are reported with its own."""
    problems = list(problems or [])
    cfg = _build(Config, raw, "", problems)
    problems += value_problems(cfg)
    if training:
        problems += training_problems(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg


def saved_config(raw: dict[str, Any]) -> Config:
    """A config an earlier run wrote (its run folder's config.json) as this version reads it: a field it
    lacks takes its default, a field this version no longer has is dropped; types are checked, values not
    (``ConfigError`` names the field)."""
    problems: list[str] = []
    cfg = _build(Config, _known(Config, raw), "", problems)
    if problems:
        raise ConfigError(problems)
    return cfg


def _known(tp: Any, value: Any) -> Any:
    """``value`` without the keys that name no field of the dataclasses of ``tp``, at any depth."""
    if dataclasses.is_dataclass(tp) and isinstance(value, dict):
        hints = typing.get_type_hints(tp)
        return {k: _known(hints[k], v) for k, v in value.items() if k in hints}
    if typing.get_origin(tp) is list and isinstance(value, list):
        (item,) = typing.get_args(tp)
        return [_known(item, v) for v in value]
    return value


def _build(cls: type, raw: Any, path: str, problems: list[str]) -> Any:
    """``cls`` from the mapping ``raw`` (at ``path``); each unknown key and each field of the wrong type is
    added to ``problems`` and left at its default, so that every problem of a config is found in one pass."""
    if not isinstance(raw, dict):
        problems.append(f"{path or '<root>'}: expected a mapping for {cls.__name__}, got {_show(raw)}")
        return cls()
    hints = typing.get_type_hints(cls)
    fields = sorted(f.name for f in dataclasses.fields(cls))
    where = f"{path}." if path else ""
    kwargs = {}
    for key, value in raw.items():
        if key not in hints:
            full = f"{where}{key}"
            problems.append(_replaced(full) if full in REPLACED_KEYS
                            else _foreign(full) or _unknown_key(full, key, fields, path or "the config"))
            continue
        try:
            kwargs[key] = _coerce(hints[key], value, f"{where}{key}", problems)
        except ConfigError as e:
            problems += e.problems
    return cls(**kwargs)


def _replaced(key: str) -> str:
    return f"'{key}' is not a key: set {REPLACED_KEYS[key]} instead"


def _coerce(tp: Any, value: Any, path: str, problems: list[str] | None = None) -> Any:
    """Check ``value`` against the annotation ``tp``; ints are accepted where floats are expected. A
    wrong value raises ``ConfigError``; a dataclass's or a list's items add theirs to ``problems``."""
    problems = [] if problems is None else problems
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path, problems)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            near = _nearest(value, [a for a in allowed if isinstance(a, str)]) if isinstance(value, str) else None
            hint = f" (did you mean {near!r}?)" if near else ""
            raise ConfigError(f"{path}: expected one of {list(allowed)}, got {_show(value)}{hint}")
        return value
    if origin in (typing.Union, types.UnionType):
        for arm in typing.get_args(tp):
            try:
                arm_problems: list[str] = []
                out = _coerce(arm, value, path, arm_problems)
            except ConfigError:
                continue
            if not arm_problems:
                return out
        raise ConfigError(f"{path}: expected {_type_name(tp)}, got {_show(value)}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {_show(value)}")
        (item,) = typing.get_args(tp)
        items = []
        for i, v in enumerate(value):
            try:
                items.append(_coerce(item, v, f"{path}[{i}]", problems))
            except ConfigError as e:
                problems += e.problems
        return items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {_show(value)}")
        _, item = typing.get_args(tp)
        return {k: _coerce(item, v, f"{path}.{k}", problems) for k, v in value.items()}
    if tp is type(None):
        if value is not None:
            raise ConfigError(f"{path}: expected null, got {_show(value)}")
        return None
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, bool):
        raise ConfigError(f"{path}: expected int, got {_show(value)}")
    if not isinstance(value, tp):
        raise ConfigError(f"{path}: expected {_type_name(tp)}, got {_show(value)}")
    return value


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _show(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def validate(cfg: Config) -> None:
    """Value checks the types cannot express. Raises :class:`ConfigError` naming each field that fails."""
    problems = value_problems(cfg)
    if problems:
        raise ConfigError(problems)


def validate_training(cfg: Config) -> None:
    """The checks only training needs (``megareason train`` runs them before any worker starts); raises
    :class:`ConfigError` naming each field that fails."""
    problems = training_problems(cfg)
    if problems:
        raise ConfigError(problems)
