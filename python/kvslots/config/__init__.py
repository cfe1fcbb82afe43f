"""Configuration, one home per rule: TRT-LLM engine YAML (:mod:`.trtllm`), speculators
checkpoints (:mod:`.speculators`), dynamic speculative-decoding schedules (:mod:`.schedule`),
the connector's extra config (:mod:`.connector`) and the ``kvslots convert-config`` command
(:mod:`.cli`). Nothing here imports vLLM at import time."""

from ..errors import ConfigError
from .connector import ConnectorConfig, ConnectorConfigError

__all__ = ["ConfigError", "ConnectorConfig", "ConnectorConfigError"]
