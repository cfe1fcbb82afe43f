"""How `make test` spreads the suite over pytest-xdist workers (``-n 2``).

The tests that run vLLM engines or servers are one unit of work, run one at a time on one
worker: they pin cores, bind vLLM's default ports and each fills a 2-core machine on its own.
Every other module is a unit of its own, so its module-scoped fixtures (a Redis server, built
models) start once and tests that read what earlier tests of the module recorded run after
them, on one worker. Without xdist (a plain ``pytest``) this file does nothing.

(The grouping is a scheduler of our own rather than ``--dist loadgroup``: xdist 3.8 tags a
grouped test by rewriting ``item._nodeid``, which pytest 9.2 no longer reads.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

@contextlib.contextmanager
def loggers_kept() -> Iterator[None]:
    """The loggers the commands set (:func:`kvslots._ratelog.quiet_logs`: httpx's level, uvicorn.error's
    filters; uvicorn's own set-up: its level) as they were before the block, after it."""
    import logging

    httpx_log, error = logging.getLogger("httpx"), logging.getLogger("uvicorn.error")
    httpx_level, error_level, filters = httpx_log.level, error.level, list(error.filters)
    try:
        yield
    finally:
        httpx_log.setLevel(httpx_level)
        error.setLevel(error_level)
        error.filters[:] = filters


@pytest.fixture(autouse=True)
def _loggers_as_they_were() -> Iterator[None]:
    """Every test runs in :func:`loggers_kept`: a test reaching the loggers through ``kvslots
    proxy`` or ``kvslots indexer`` left them set for the rest of the run."""
    with loggers_kept():
        yield


# Modules whose tests start vLLM engines, `kvslots serve` / `vllm serve` or the demo, and such
# tests in modules that are otherwise light.
ENGINE_MODULES = frozenset({
    "test_demo.py", "test_disk_engine.py", "test_pd_engine.py", "test_pd_served.py",
    "test_scheduler_mode_engine.py", "test_vllm_engine.py",
})
ENGINE_TESTS = frozenset({"test_serve.py::test_serve_end_to_end"})


def work_unit(nodeid: str) -> str:
    """The unit of work a test belongs to: "engine", or its module."""
    path, _, name = nodeid.partition("::")
    module = path.rsplit("/", 1)[-1]
    if module in ENGINE_MODULES or f"{module}::{name.split('[', 1)[0]}" in ENGINE_TESTS:
        return "engine"
    return module


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

        def _assign_work_unit(self, node) -> None:
            # The engine unit is the longest: it starts first, the others fill the other worker.
            if "engine" in self.workqueue:
                self.workqueue.move_to_end("engine", last=False)
            super()._assign_work_unit(node)

    return ByWorkUnit(config, log)
