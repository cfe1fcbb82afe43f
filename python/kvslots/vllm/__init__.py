"""kvslots inside vLLM: the KVSlotsConnector (``--kv-transfer-config``).

Loaded by module path (``"kv_connector_module_path": "kvslots.vllm"``) or, with kvslots
installed, by name alone: the ``vllm.general_plugins`` entry point calls :func:`register`.
"""

from .config import ConnectorConfig, ConnectorConfigError
from .connector import KVSlotsConnector

CONNECTOR_NAME = "KVSlotsConnector"


def register() -> None:
    """vLLM plugin hook: makes ``"kv_connector": "KVSlotsConnector"`` work without a module path.
    vLLM may load plugins more than once per process, so this is idempotent."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "kvslots.vllm.connector", CONNECTOR_NAME)


__all__ = ["KVSlotsConnector", "ConnectorConfig", "ConnectorConfigError", "register", "CONNECTOR_NAME"]
