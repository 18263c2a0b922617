"""The run configuration: one section per component, loaded from YAML/JSON, flags and
`--set` overrides, validated with one line per problem."""

from disttrain.config.loading import (
    SYSTEM_ALIASES,
    config_from_dict,
    load_config,
    parse_set_expression,
)
from disttrain.config.schema import (
    STRATEGY_OF_ARCHITECTURE,
    CompressionConfig,
    Config,
    CoordinatorConfig,
    DDPConfig,
    PSConfig,
    SystemConfig,
    TrainingConfig,
)
from disttrain.config.usage import NOT_JUDGED, STRATEGIES, ignored_keys

__all__ = ["NOT_JUDGED", "STRATEGIES", "STRATEGY_OF_ARCHITECTURE", "SYSTEM_ALIASES",
           "CompressionConfig", "Config", "CoordinatorConfig", "DDPConfig", "PSConfig", "SystemConfig",
           "TrainingConfig", "config_from_dict", "ignored_keys", "load_config", "parse_set_expression"]
