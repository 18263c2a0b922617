"""What the parameter server supports of a config, checked before any process starts."""

from __future__ import annotations

from disttrain.config import Config
from disttrain.core.errors import ConfigError


def check_supported(config: Config) -> None:
    """Raises ConfigError for settings the parameter server does not offer."""
    if config.compression.enabled and config.compression.type == "powersgd":
        raise ConfigError("compression.type: powersgd compresses DDP's all-reduce and is not "
                          "offered on the parameter server; use quantization, topk, fp16 or bf16")
