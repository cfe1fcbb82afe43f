"""The package type-checks: mypy over ``python/kvslots`` with the settings in pyproject.toml.

mypy reads vLLM's, torch's and pydantic's own annotations, so a call that does not match the
installed vLLM (a renamed attribute, an Optional left unchecked) fails here. Cold, this takes
about 1.5 min of CPU on this project's machines (torch and vLLM are analysed once).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mypy", reason="mypy is not installed (requirements/dev.txt; make test installs it)")

import kvslots  # noqa: E402  (after the skip: only to locate the tree under test)

ROOT = Path(kvslots.__file__).resolve().parent.parent.parent


def test_package_type_checks() -> None:
    config = ROOT / "pyproject.toml"
    if not config.is_file():
        pytest.skip(f"kvslots is installed without its sources here ({ROOT}): nothing to check")
    # The checkout's own cache (.mypy_cache, which mypy keeps out of git): cold in CI.
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(config), str(ROOT / "python" / "kvslots")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, f"mypy found errors:\n{proc.stdout[-20000:]}{proc.stderr[-4000:]}"
