"""kvslots: a KV-cache block slot manager for speculative decoding.

The engine is Rust (``kvslots._core``). The package has one subpackage per part:

- :mod:`kvslots.slots`: the slot API over the core, and the pure-Python reference model;
- :mod:`kvslots.events`: KV events in vLLM's wire format, publisher and subscriber;
- :mod:`kvslots.vllm`: the KV connector, and the block copies it runs;
- :mod:`kvslots.indexer`: the prefix-cache event subscriber service;
- :mod:`kvslots.config`: TRT-LLM YAML, speculators checkpoints, dynamic-SD schedules, connector settings;
- :mod:`kvslots.serve`, :mod:`kvslots.demo`: launchers; ``kvslots._dev``: tiny models and the simulator.

Every error is a :class:`KVSlotsError`.
"""

from ._core import HostCache, SlotInfo, SlotTracker, __version__, block_hash
from .errors import (
    ArgumentTypeError,
    CapacityExceededError,
    ConcurrentUseError,
    ConfigError,
    ConnectorConfigError,
    DuplicateRequestError,
    InvalidArgumentError,
    InvalidRollbackError,
    KVSlotsError,
    NotCopyableError,
    OutOfDescriptorsError,
    OutOfBlocksError,
    ServeError,
    SlotError,
    UnknownRequestError,
)
from .slots import SlotManager

__all__ = [
    "SlotManager",
    "SlotTracker",
    "HostCache",
    "SlotInfo",
    "block_hash",
    "KVSlotsError",
    "SlotError",
    "UnknownRequestError",
    "DuplicateRequestError",
    "OutOfBlocksError",
    "InvalidRollbackError",
    "CapacityExceededError",
    "InvalidArgumentError",
    "ArgumentTypeError",
    "ConcurrentUseError",
    "NotCopyableError",
    "OutOfDescriptorsError",
    "ConfigError",
    "ConnectorConfigError",
    "ServeError",
    "__version__",
]
