"""A stand-in for vLLM's Request with what ConnectorPlanner reads (shared by the planner tests)."""
from __future__ import annotations

import random

BS = 4


class Req:
    def __init__(self, i: int, rng: random.Random, n: int | None = None):
        # n tokens, all computed; n // BS full blocks hashed, one more block allocated
        n = rng.randrange(5, 15) if n is None else n
        self.request_id = f"r{i}"
        self._all_token_ids = [rng.randrange(1, 1000) for _ in range(n)]
        self.num_prompt_tokens = n
        self.lora_request = None
        self.num_computed_tokens = n
        self.num_in_flight_tokens = 0
        self.block_hashes = [rng.getrandbits(63) for _ in range(n // BS)]
        self.blocks = [i * 1000 + j for j in range(n // BS + 1)]

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)
