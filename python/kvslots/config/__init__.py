"""Configuration, one home per rule: what a model reference names and vLLM's speculative config
(:mod:`.speculative`), TRT-LLM engine YAML (:mod:`.trtllm`), speculators checkpoints
(:mod:`.speculators`), dynamic speculative-decoding schedules (:mod:`.schedule`), vLLM engine
arguments as flags (:mod:`.vllm_args`), the connector's extra config (:mod:`.connector`) and the
``kvslots convert-config`` command (:mod:`.cli`). Nothing here imports vLLM at import time."""

from ..errors import ConfigError
from .connector import ConnectorConfig, ConnectorConfigError

__all__ = ["ConfigError", "ConnectorConfig", "ConnectorConfigError"]
