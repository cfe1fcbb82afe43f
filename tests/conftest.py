"""How `make test` spreads the suite over pytest-xdist workers (``-n 2``).

The modules whose tests run vLLM engines or servers are one unit of work, run one test at a time
on one worker: they pin cores, bind vLLM's default ports and each fills a 2-core machine on its
own. Every other module is a unit of its own, so its module-scoped fixtures (a Redis server,
built models) start once and tests that read what earlier tests of the module recorded run
after them, on one worker. Without xdist (a plain ``pytest``) this file does nothing.

(The grouping is a scheduler of our own rather than ``--dist loadgroup``: xdist 3.8 tags a
grouped test by rewriting ``item._nodeid``, which pytest 9.2 no longer reads.)
"""

from __future__ import annotations

import os

import pytest

# Mooncake's transfer engine (tests that load it in process) logs INFO lines to stderr when it is
# torn down at a worker's exit, outside any capture: only warnings and errors.
os.environ.setdefault("GLOG_minloglevel", "2")

# Modules whose tests start vLLM engines, `kvslots serve` / `vllm serve` or the demo.
ENGINE_MODULES = frozenset({
    "test_demo.py", "test_disk_config.py", "test_disk_engine.py", "test_events_subscriber_model.py",
    "test_pd_engine.py", "test_pd_serve.py", "test_pd_served.py", "test_scheduler_mode_engine.py",
    "test_serve.py", "test_trtllm.py", "test_vllm_engine.py",
})


def work_unit(nodeid: str) -> str:
    """The unit of work a test belongs to: "engine", or its module."""
    module = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    return "engine" if module in ENGINE_MODULES else module


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return ByWorkUnit(config, log)
