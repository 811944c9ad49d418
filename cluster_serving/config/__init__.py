"""The serving configuration: cluster_serving/config/config.yaml holds the defaults, conf.schema validates."""

from cluster_serving.config.schema import (
    DEFAULT_CONFIG_PATH,
    JOB_NAME,
    KAFKA_RECORD_BYTES,
    BatchingConfig,
    ConfigError,
    FlinkConfig,
    HttpConfig,
    ImageConfig,
    KafkaConfig,
    LimitsConfig,
    ModelConfig,
    PostprocessConfig,
    PreprocessConfig,
    ServingConfig,
    defaults,
    load_config,
)

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "JOB_NAME",
    "KAFKA_RECORD_BYTES",
    "BatchingConfig",
    "ConfigError",
    "FlinkConfig",
    "HttpConfig",
    "ImageConfig",
    "KafkaConfig",
    "LimitsConfig",
    "ModelConfig",
    "PostprocessConfig",
    "PreprocessConfig",
    "ServingConfig",
    "defaults",
    "load_config",
]
