"""Disaggregated prefill/decode: the prefill worker computes a prompt's KV (target and draft
layers), the decode worker pulls the committed blocks and decodes.

- :mod:`.layout`: where each block of every layer lives (:class:`BlockLayout`), what two
  workers compare before exchanging blocks;
- :mod:`.transport`: batched block reads over Mooncake's transfer engine
  (:class:`MooncakeTransport`).
"""

from .layout import BlockLayout, Segment
from .transport import MooncakeTransport, PendingRead

__all__ = ["BlockLayout", "Segment", "MooncakeTransport", "PendingRead"]
