"""``kvslots proxy`` imports httpx at run time, but pyproject listed it only in the test extra:
``pip install 'kvslots[indexer]'`` (the extra with the proxy's FastAPI and uvicorn) gave a proxy
that failed at start. Every third-party module the proxy imports must come with the package's
dependencies or the indexer extra (directly, or as a requirement of one of them)."""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
from pathlib import Path

import pytest

if sys.version_info < (3, 11):
    pytest.skip("tomllib is Python 3.11+", allow_module_level=True)
import tomllib  # noqa: E402

ROOT = Path(__file__).parents[1]


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_the_proxys_imports_come_with_the_indexer_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    given = {_name(r) for r in [*project["dependencies"], *project["optional-dependencies"]["indexer"]]}
    covered = set(given)
    for dist in given:  # and what they require
        try:
            covered |= {_name(r) for r in md.requires(dist) or [] if "extra ==" not in r}
        except md.PackageNotFoundError:
            pass
    modules = set()
    for path in (ROOT / "python" / "kvslots" / "proxy").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules |= {a.name.partition(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.partition(".")[0])
    dists = md.packages_distributions()
    third_party = {m for m in modules if m not in sys.stdlib_module_names and m != "kvslots"}
    assert {"httpx", "fastapi", "uvicorn"} <= third_party
    missing = {m for m in third_party if not {_name(d) for d in dists.get(m, [m])} & covered}
    assert not missing, f"imported by the proxy, not installed by kvslots[indexer]: {sorted(missing)}"
