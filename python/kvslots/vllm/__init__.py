"""kvslots inside vLLM.

- :class:`KVSlotsConnector` (``--kv-transfer-config``): the host tier under vLLM's manager
  (:mod:`.connector`), with whole-block copies in :mod:`.transfer`.
- :class:`KVSlotsScheduler` (``--scheduler-cls kvslots.vllm.KVSlotsScheduler``): scheduler mode,
  the Rust core allocates vLLM's device KV blocks (:mod:`.scheduler`); async variant
  :class:`KVSlotsAsyncScheduler`.

Loaded by module path (``"kv_connector_module_path": "kvslots.vllm"``) or, with kvslots
installed, by name alone: the ``vllm.general_plugins`` entry point calls :func:`register`.
Importing this package does not import vLLM; the classes load it on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..config.connector import ConnectorConfig, ConnectorConfigError

if TYPE_CHECKING:
    from .connector import KVSlotsConnector
    from .scheduler import KVSlotsAsyncScheduler, KVSlotsScheduler

CONNECTOR_NAME = "KVSlotsConnector"


def register() -> None:
    """vLLM plugin hook: makes ``"kv_connector": "KVSlotsConnector"`` work without a module path.
    vLLM may load plugins more than once per process, so this is idempotent."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "kvslots.vllm.connector", CONNECTOR_NAME)


def __getattr__(name: str) -> Any:
    # vLLM resolves the connector class as an attribute of this module (kv_connector_module_path).
    if name == "KVSlotsConnector":
        from .connector import KVSlotsConnector

        return KVSlotsConnector
    if name in ("KVSlotsScheduler", "KVSlotsAsyncScheduler"):
        from . import scheduler

        return getattr(scheduler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["KVSlotsConnector", "KVSlotsScheduler", "KVSlotsAsyncScheduler", "ConnectorConfig", "ConnectorConfigError", "register", "CONNECTOR_NAME"]
