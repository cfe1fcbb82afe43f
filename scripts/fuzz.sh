#!/usr/bin/env bash
# The long run of the reliability harness (CI runs the short one inside `make test`):
#   - proptest over random operation sequences of SlotManager / SlotTracker / HostCache against a
#     model (rust/core/tests/fuzz_ops.rs), PROPTEST_CASES cases per property;
#   - hypothesis over every public call of the extension with arguments of every type and value,
#     re-entrancy and threads (tests/test_bindings_robust.py), and the reference model's
#     agreement with the core (tests/test_reference_agreement.py, tests/test_properties.py),
#     KVSLOTS_HYPOTHESIS_EXAMPLES cases per test.
# Usage: scripts/fuzz.sh [PROPTEST_CASES] [KVSLOTS_HYPOTHESIS_EXAMPLES]   (defaults 200000, 20000)
# A failure prints the shrunk case: add it as a named regression test (rust/core/tests/*.rs or
# tests/test_bindings_robust.py) before fixing it.
set -euo pipefail
cd "$(dirname "$0")/.."
CASES=${1:-200000}
EXAMPLES=${2:-20000}
PY=${PY:-.venv/bin/python}
PROPTEST_CASES=$CASES cargo test -p kvslots-core --release -q --test fuzz_ops --test overflow --test host_cache_atomic
KVSLOTS_HYPOTHESIS_EXAMPLES=$EXAMPLES $PY -m pytest -q tests/test_bindings_robust.py tests/test_reference_agreement.py tests/test_properties.py
