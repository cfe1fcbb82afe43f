"""The hand-kept stub ``kvslots/_core.pyi`` matches the built extension (mypy's stubtest).

stubtest imports ``kvslots._core`` and compares every name, signature, default, class flag
(final, disjoint base) and ``__all__`` with the stub. It cannot compare types: runtime pyo3
functions carry none.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "mypy.stubtest", reason="mypy is not installed (requirements/dev.txt; make test installs it)"
)

import kvslots._core  # noqa: E402  (after the skip: only to locate the tree under test)


def test_core_stub_matches_the_extension(tmp_path: Path) -> None:
    # The stub and the extension stubtest loads must come from the tree this test imported.
    src = Path(kvslots._core.__file__).resolve().parent.parent
    assert (src / "kvslots" / "_core.pyi").is_file()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(src), env.get("PYTHONPATH")) if p)
    env["MYPYPATH"] = str(src)
    proc = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "kvslots._core", "--concise"],
        cwd=tmp_path,  # no config file or cache of the checkout gets picked up
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"stubtest found differences:\n{proc.stdout}{proc.stderr}"
