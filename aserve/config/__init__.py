"""The JSON config: its schema (:mod:`.schema`) and reading it (:mod:`.load`).

Layer ``config``, above ``types`` and ``errors`` only. ``from aserve.config
import ModelConfig, parse_config`` keeps working for every name of those two
modules. The checks that need files, engines and handler modules live in
:mod:`aserve.engines.checks` (engines layer), imported by the commands, the
CLI, the server and a reload, never from here.
"""

from __future__ import annotations

from aserve.config.load import ConfigError, load_config, parse_config, read_config
from aserve.config.schema import (
    PROMPT_BYTES_PER_TOKEN,
    AuthConfig,
    BatchingConfig,
    DashboardConfig,
    Datatype,
    DeviceConfig,
    EmbeddingsConfig,
    GenerationConfig,
    GpuConfig,
    GrpcConfig,
    HttpConfig,
    LimitsConfig,
    LoggingConfig,
    ModelConfig,
    PipelineStep,
    QueuePolicy,
    SequenceBatchingConfig,
    SequenceControls,
    SequenceState,
    ServerConfig,
    TensorSpec,
    TlsConfig,
)

__all__ = [
    "PROMPT_BYTES_PER_TOKEN",
    "AuthConfig",
    "BatchingConfig",
    "ConfigError",
    "DashboardConfig",
    "Datatype",
    "DeviceConfig",
    "EmbeddingsConfig",
    "GenerationConfig",
    "GpuConfig",
    "GrpcConfig",
    "HttpConfig",
    "LimitsConfig",
    "LoggingConfig",
    "ModelConfig",
    "PipelineStep",
    "QueuePolicy",
    "SequenceBatchingConfig",
    "SequenceControls",
    "SequenceState",
    "ServerConfig",
    "TensorSpec",
    "TlsConfig",
    "load_config",
    "parse_config",
    "read_config",
]
