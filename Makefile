# The two commands of the README; each does all the set-up it needs first.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test setup bench

demo:  ## the main job: a tiny local model served with the connector, KV events and the indexer
	@VENV=$(VENV) scripts/setup.sh --with-vllm
	$(PY) -m kvslots demo

test:  ## the whole test suite: Rust engine tests, then pytest (with vLLM on CPU)
	@VENV=$(VENV) scripts/setup.sh --with-vllm
	cargo test -p kvslots-core --release -q
	$(PY) -m pytest -q

setup:
	@VENV=$(VENV) scripts/setup.sh --with-vllm

bench:  ## quick benchmarks: one EAGLE trace through kvslots and vLLM's KVCacheManager, then the engine's own figures
	@VENV=$(VENV) scripts/setup.sh --with-vllm
	$(PY) benches/bench_slots.py --quick
	$(PY) benches/bench_engine.py --quick
