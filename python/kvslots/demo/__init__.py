"""``kvslots demo``: the main job, a tiny local model served through ``kvslots serve`` with the
connector, KV events and an in-process indexer (:mod:`.run`)."""
