"""Moves multimodal embeddings from encode ranks into prefill ranks' registered buffers."""

from transfer.errors import (
    BootstrapError,
    BootstrapUnreachable,
    ConfigError,
    ConfigTypeError,
    EngineError,
    EngineUnavailable,
    FallbackLimitError,
    SlotError,
    TransferError,
    WireError,
)

__version__ = "0.1.0"

__all__ = [
    "BootstrapError",
    "BootstrapUnreachable",
    "ConfigError",
    "ConfigTypeError",
    "EngineError",
    "EngineUnavailable",
    "FallbackLimitError",
    "SlotError",
    "TransferError",
    "WireError",
    "__version__",
]
