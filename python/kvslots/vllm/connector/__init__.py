"""The KVSlotsConnector: vLLM's KV connector API over the host tier (:mod:`.connector`), with its
scheduler side (:mod:`.scheduler_side`: lookups, load/store planning) and worker side
(:mod:`.worker_side`: copies through :mod:`kvslots.vllm.transfer`)."""

from .connector import KVSlotsConnector

__all__ = ["KVSlotsConnector"]
