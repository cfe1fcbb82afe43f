"""Scheduler mode: the kvslots Rust core is vLLM's device KV cache manager.

- :class:`KVSlotsScheduler` (``--scheduler-cls kvslots.vllm.KVSlotsScheduler``) and its async
  variant :class:`KVSlotsAsyncScheduler`: vLLM's scheduler over
- :class:`KVSlotsKVCacheManager`: vLLM's ``KVCacheManager`` interface over the Rust allocator.

Importing this package imports vLLM.
"""

from .kv_cache_manager import USE_VLLM, KVSlotsKVCacheManager, SchedulerModeError, check_supported
from .scheduler import SUPPORTED_VLLM, KVSlotsAsyncScheduler, KVSlotsScheduler

__all__ = ["KVSlotsScheduler", "KVSlotsAsyncScheduler", "KVSlotsKVCacheManager", "SchedulerModeError",
           "check_supported", "SUPPORTED_VLLM", "USE_VLLM"]
