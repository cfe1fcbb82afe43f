# The two commands of the README; each does all the set-up it needs first.
VENV ?= .venv
PY := $(VENV)/bin/python
# The second environment: vLLM 0.33 (scheduler level only: a CUDA build, used on CPU).
VENV033 ?= .venv-033
PY033 := $(VENV033)/bin/python
# What runs against vLLM 0.33 as well: the scheduler-level connector tests, the events and
# indexer tests that touch vLLM's event classes, and scheduler mode (fewer examples: the 0.32 run
# already does 300 per test). Engine-level tests run against 0.32 only (the newest CPU build).
TESTS_033 := tests/test_vllm033_compat.py tests/test_connector_scheduler.py tests/test_events_vllm.py tests/test_vllm033_lookahead.py \
	tests/test_scheduler_mode_manager.py tests/test_scheduler_mode_differential.py tests/test_events_successors.py
SCHED_EXAMPLES_033 ?= 5
# pytest workers (pytest-xdist); tests/conftest.py keeps the engine tests on one of them, one at a time.
PYTEST_WORKERS ?= 2

.PHONY: demo test test-033 setup bench

demo:  ## the main job: a tiny local model served with the connector, KV events and the indexer
	@VENV=$(VENV) scripts/setup.sh --with-vllm
	$(PY) -m kvslots demo

test:  ## the whole test suite: Rust engine tests, pytest with vLLM 0.32 (CPU), then the scheduler-level tests again with vLLM 0.33
	@VENV=$(VENV) VENV033=$(VENV033) scripts/setup.sh --with-vllm --with-vllm-033
	cargo test -p kvslots-core --release -q
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --durations=15
	VLLM_TARGET_DEVICE=cpu KVSLOTS_SCHED_EXAMPLES=$(SCHED_EXAMPLES_033) $(PY033) -m pytest -q -p no:cacheprovider $(TESTS_033)

test-033:  ## only the vLLM 0.33 part of `make test`
	@VENV=$(VENV) VENV033=$(VENV033) scripts/setup.sh --with-vllm --with-vllm-033
	VLLM_TARGET_DEVICE=cpu KVSLOTS_SCHED_EXAMPLES=$(SCHED_EXAMPLES_033) $(PY033) -m pytest -q -p no:cacheprovider $(TESTS_033)

setup:
	@VENV=$(VENV) scripts/setup.sh --with-vllm

bench:  ## quick benchmarks: one EAGLE trace through kvslots and vLLM's KVCacheManager, then the engine's own figures
	@VENV=$(VENV) scripts/setup.sh --with-vllm
	$(PY) benches/bench_slots.py --quick
	$(PY) benches/bench_engine.py --quick
