"""Moves multimodal embeddings from encode ranks into prefill ranks' registered buffers."""

import logging

from transfer import errors
from transfer.errors import (
    BootstrapError,
    BootstrapNoRoute,
    BootstrapUnreachable,
    CollectiveError,
    ConfigError,
    ConfigTypeError,
    EngineError,
    EngineUnavailable,
    FallbackLimitError,
    ListenError,
    PortsInUse,
    SlotError,
    TransferError,
    UsageError,
    WireError,
)

__version__ = "0.1.0"

# A library leaves handlers to the application: without one configured, Python's
# last-resort handler would print our warnings to stderr on its own.
logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = ["__version__"]
__all__ += errors.__all__
