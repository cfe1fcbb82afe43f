"""The slot API: the Rust :class:`SlotManager` / :class:`SlotTracker` / :class:`HostCache` and the
pure-Python reference model (:mod:`kvslots.slots.reference`, the test oracle)."""

from .._core import HostCache, SlotInfo, SlotTracker, block_hash
from .manager import SlotManager

__all__ = ["SlotManager", "SlotTracker", "HostCache", "SlotInfo", "block_hash"]
