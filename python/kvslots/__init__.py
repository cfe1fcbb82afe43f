"""kvslots: a KV-cache block slot manager for speculative decoding.

The engine is Rust (``kvslots._core``); this package adds the typed Python API, the
pure-Python reference model, KV events and the ``kvslots`` command line.
"""

from ._core import HostCache, SlotInfo, SlotTracker, __version__, block_hash
from .errors import (
    CapacityExceededError,
    ConfigError,
    DuplicateRequestError,
    InvalidArgumentError,
    InvalidRollbackError,
    OutOfBlocksError,
    SlotError,
    UnknownRequestError,
)
from .manager import SlotManager

__all__ = [
    "SlotManager",
    "SlotTracker",
    "HostCache",
    "SlotInfo",
    "block_hash",
    "SlotError",
    "UnknownRequestError",
    "DuplicateRequestError",
    "OutOfBlocksError",
    "InvalidRollbackError",
    "CapacityExceededError",
    "InvalidArgumentError",
    "ConfigError",
    "__version__",
]
