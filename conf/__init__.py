"""The serving configuration: conf/config.yaml holds the defaults, conf.schema validates."""

from conf.schema import (
    DEFAULT_CONFIG_PATH,
    JOB_NAME,
    BatchingConfig,
    ConfigError,
    FlinkConfig,
    HttpConfig,
    KafkaConfig,
    LimitsConfig,
    ModelConfig,
    ServingConfig,
    load_config,
)

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "JOB_NAME",
    "BatchingConfig",
    "ConfigError",
    "FlinkConfig",
    "HttpConfig",
    "KafkaConfig",
    "LimitsConfig",
    "ModelConfig",
    "ServingConfig",
    "load_config",
]
