"""Typed configuration (``schema``) and its hydra-based loading and validation (``load``)."""

from megareason.config.load import (
    CONFIG_DIR,
    ConfigError,
    from_dict,
    load_config,
    saved_config,
    validate,
    validate_training,
)
from megareason.config.schema import (
    Config,
    DataConfig,
    DataSourceConfig,
    EvalConfig,
    ModelConfig,
    RolloutConfig,
)

__all__ = [
    "CONFIG_DIR",
    "Config",
    "ConfigError",
    "DataConfig",
    "DataSourceConfig",
    "EvalConfig",
    "ModelConfig",
    "RolloutConfig",
    "from_dict",
    "load_config",
    "saved_config",
    "validate",
    "validate_training",
]
