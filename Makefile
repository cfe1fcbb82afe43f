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
# The summed-preemption test's fixed cases under 0.33: the first 100 of the 0.32 run's 300.
SUMMED_CASES_033 ?= 100
# The 0.33 part's test ports (tests/ports.py), apart from the 0.32 run's 20000-32000.
PORTS_033 ?= 12000-14000
# pytest workers (pytest-xdist); tests/conftest.py keeps the engine tests on one of them, one at a time.
PYTEST_WORKERS ?= 2

.PHONY: demo test test-033 setup bench

demo:  ## the main job: a tiny local model served with the connector, KV events and the indexer
	@VENV=$(VENV) scripts/setup.sh --with-vllm
	$(PY) -m kvslots demo

test:  ## the whole test suite: Rust engine tests, pytest with vLLM 0.32 (CPU), and beside it the scheduler-level tests again with vLLM 0.33
	@VENV=$(VENV) VENV033=$(VENV033) scripts/setup.sh --with-vllm --with-vllm-033
	@# The dev profile: overflow checks and debug assertions stay on, and its build (with
	@# proptest and criterion) takes about 1 min here against 2.5 min for --release.
	cargo test -p kvslots-core -q
	@# The 0.33 part runs beside the 0.32 one, niced, on its own test ports: the 0.32 run's
	@# second worker is idle while the first one runs the engine tests; its output follows.
	@out033=$$(mktemp); \
	VLLM_TARGET_DEVICE=cpu KVSLOTS_SCHED_EXAMPLES=$(SCHED_EXAMPLES_033) KVSLOTS_SUMMED_CASES=$(SUMMED_CASES_033) KVSLOTS_TEST_PORTS=$(PORTS_033) \
	  nice -n 10 $(PY033) -m pytest -q -p no:cacheprovider $(TESTS_033) >"$$out033" 2>&1 & bg=$$!; \
	trap 'kill $$bg 2>/dev/null' INT TERM; \
	echo "$(PY) -m pytest -q -n $(PYTEST_WORKERS) --durations=15   (the vLLM 0.33 part runs beside it)"; \
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --durations=15; rc=$$?; \
	wait $$bg; rc033=$$?; \
	echo "== vLLM 0.33: $(PY033) -m pytest -q $(TESTS_033)"; cat "$$out033"; rm -f "$$out033"; \
	test $$rc -eq 0 && test $$rc033 -eq 0

test-033:  ## only the vLLM 0.33 part of `make test`
	@VENV=$(VENV) VENV033=$(VENV033) scripts/setup.sh --with-vllm --with-vllm-033
	VLLM_TARGET_DEVICE=cpu KVSLOTS_SCHED_EXAMPLES=$(SCHED_EXAMPLES_033) KVSLOTS_SUMMED_CASES=$(SUMMED_CASES_033) $(PY033) -m pytest -q -p no:cacheprovider $(TESTS_033)

setup:
	@VENV=$(VENV) scripts/setup.sh --with-vllm

bench:  ## quick benchmarks: one EAGLE trace through kvslots and vLLM's KVCacheManager, then the engine's own figures
	@VENV=$(VENV) scripts/setup.sh --with-vllm
	$(PY) benches/bench_slots.py --quick
	$(PY) benches/bench_engine.py --quick
