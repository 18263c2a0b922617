"""What the parameter server supports of a config, checked before any process starts."""

from __future__ import annotations

from disttrain.config import Config
from disttrain.core.errors import ConfigError


def check_supported(config: Config) -> None:
    """Raises ConfigError for settings the parameter server does not offer yet."""
    if config.compression.enabled:
        raise ConfigError("compression.enabled: gradient compression is not available in the "
                          "parameter server yet; set it to false")
