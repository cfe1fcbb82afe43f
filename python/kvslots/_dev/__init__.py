"""Development helpers for tests, benchmarks and the demo (tiny random-weight models, the
workload simulator). Not part of the public API."""
