"""``kvslots proxy``: the OpenAI-compatible front door of disaggregated prefill/decode
(:mod:`.app`), its command (:mod:`.cli`)."""
