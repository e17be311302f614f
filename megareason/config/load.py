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
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

from megareason.config.checks import training_problems, value_problems
from megareason.config.schema import Config

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


DEFAULTS_NODE = "megareason_defaults"

# Keys that do not exist, with the keys that do their work: a config or override that sets one is refused
# naming them (instead of a bare "unknown key").
REPLACED_KEYS = {
    "algorithm.kl_kind": "algorithm.kl_reward_kind (the KL subtracted from the reward, kl_in_reward) and "
                         "algorithm.kl_loss_kind (the KL loss term)",
}

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
    return from_dict(raw, training, problems)


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
                            else _unknown_key(full, key, fields, path or "the config"))
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
