"""README.md and docs/*.md checked against the code where that is mechanical: the options of
every ``kvslots COMMAND ...`` line shown, the connector's key table and the indexer's options
table with their defaults, the exception classes, ``kvslots.*`` names, metric names and the
repository paths they name. Fast: the parsers and a few light modules are imported, the rest is
read with ``ast`` (nothing imports vLLM or torch)."""

from __future__ import annotations

import argparse
import ast
import builtins
import dataclasses
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "python" / "kvslots"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def code_units(text: str) -> list[tuple[int, str]]:
    """(line number, text) of every inline code span and every line of a fenced or indented code
    block, a block's backslash-continued lines joined and its ``# comments`` dropped."""
    units: list[tuple[int, str]] = []
    fenced = False
    pending: tuple[int, str] | None = None
    for no, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            line = re.sub(r"(^|\s)#\s.*$", "", line)
            if pending is not None:
                no, line = pending[0], pending[1] + " " + line
            if line.rstrip().endswith("\\"):
                pending = (no, line.rstrip()[:-1])
                continue
            pending = None
            units.append((no, line))
        else:
            units.extend((no, m.group(1)) for m in re.finditer(r"`([^`]+)`", line))
    return units


@functools.cache
def subcommand_options() -> dict[str, set[str]]:
    from kvslots.cli import build_parser

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return {name: {o for act in p._actions for o in act.option_strings} for name, p in sub.choices.items()}


def unknown_options(text: str) -> list[str]:
    """Every ``-x`` / ``--xyz`` that follows ``kvslots COMMAND`` in one code unit (up to a lone
    ``--``, after which vLLM's own arguments go) and that COMMAND's parser does not have."""
    subs = subcommand_options()
    # "kvslots serve: error: ..." is a message, not a command line: the name must end in a space.
    command = re.compile(r"(?<![\w.-])kvslots (" + "|".join(map(re.escape, subs)) + r")(?=\s|$)")
    bad = []
    for no, unit in code_units(text):
        starts = list(command.finditer(unit))
        for i, m in enumerate(starts):
            rest = unit[m.end():starts[i + 1].start() if i + 1 < len(starts) else len(unit)]
            rest = re.split(r"(?:^|\s)--(?=\s|$)", rest)[0]
            for option in re.findall(r"(?<![\w./=-])(--?[A-Za-z][\w-]*)", rest):
                if option not in subs[m.group(1)]:
                    bad.append(f"{no}: kvslots {m.group(1)} has no {option}: {unit.strip()[:100]}")
    return bad


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_command_lines_use_existing_options(doc):
    assert unknown_options(doc.read_text()) == []


def test_a_planted_wrong_option_is_found():
    assert unknown_options("Run `kvslots serve MODEL --host-cache-gib 8`.")
    assert unknown_options("```\nkvslots indexer --worker w=tcp://h:1 \\\n  --frobnicate 3\n```")
    assert unknown_options("```\nkvslots proxy --prefill URL --decode URL --max-body 9 -- x\n```")
    # what is not an option of the command: vLLM's after --, a comment, an error message
    assert unknown_options("`kvslots serve M --host-cache-gb 8 -- --enforce-eager`") == []
    assert unknown_options("```\nkvslots simulate -k 3   # vllm serve --config x\n```") == []
    assert unknown_options("`kvslots serve: error: unknown option --enforce-eager`") == []


def test_readme_command_line_block_shows_every_subcommand():
    text = (ROOT / "README.md").read_text()
    block = text.split("## Command line", 1)[1].split("```", 2)[1]
    shown = set(re.findall(r"^kvslots ([\w-]+)", block, re.M))
    assert shown == set(subcommand_options())


def _table(text: str, heading: str) -> list[list[str]]:
    section = text.split(heading, 1)[1]
    section = re.split(r"\n#+ ", section, maxsplit=1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|") and not line.startswith("|--")]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows[1:]]


def _number(text: str) -> float | str | None:
    text = text.strip("`\" ")
    if text in ("none", "—", "", "off"):
        return None
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return text


def connector_default_problems(text: str) -> list[str]:
    """Each row of a ``| key | default | ...`` table whose keys are kv_connector_extra_config
    keys, against ConnectorConfig's defaults (a default cell's note in parentheses left out)."""
    from kvslots.config.connector import ConnectorConfig

    defaults = {f.name: f.default for f in dataclasses.fields(ConnectorConfig)}
    bad = []
    lines = text.splitlines()
    for i, header in enumerate(lines):
        cells = [c.strip() for c in header.split("|")[1:-1]]
        if len(cells) < 2 or "key" not in cells[0] or cells[1] != "default":
            continue
        for row in lines[i + 2:]:
            if not row.startswith("|"):
                break
            key_cell, default_cell = [c.strip() for c in re.split(r"(?<!\\)\|", row)[1:3]]
            keys = [k for k in re.findall(r"`([a-z_]+)`", key_cell) if k in defaults]
            values = [v.strip() for v in re.sub(r"\s*\(.*\)", "", default_cell).split(",")]
            if not keys:
                continue
            if len(keys) != len(values):
                bad.append(f"{key_cell}: {len(keys)} keys, {len(values)} defaults")
                continue
            for key, value in zip(keys, values):
                expect = defaults[key]
                if isinstance(expect, (int, float)) and not isinstance(expect, bool):
                    expect = float(expect)
                if _number(value) != expect:
                    bad.append(f"{key}: the doc says {value}, the code {defaults[key]!r}")
    return bad


@pytest.mark.parametrize("page", ["connector.md", "disk_tier.md", "pd.md"])
def test_connector_key_table_defaults(page):
    text = (ROOT / "docs" / page).read_text()
    assert "| default |" in text
    assert connector_default_problems(text) == []


def test_connector_table_names_every_key_with_its_default():
    from kvslots.config.connector import ConnectorConfig

    rows = _table((ROOT / "docs" / "connector.md").read_text(), "## `kv_connector_extra_config`")
    assert {k for row in rows for k in re.findall(r"`([a-z_]+)`", row[0])} == {
        f.name for f in dataclasses.fields(ConnectorConfig)}
    planted = "| key | default |\n|---|---|\n| `copy_threads` | 2 |\n| `pd_port` | none (serve: 17600) |\n"
    assert connector_default_problems(planted) == ["copy_threads: the doc says 2, the code 1"]


def test_indexer_options_table():
    from kvslots.indexer.config import DEFAULT_WEIGHTS, IndexerConfig

    options = subcommand_options()["indexer"]
    cfg = IndexerConfig()
    rows = _table((ROOT / "docs" / "indexer.md").read_text(), "### Options")
    assert rows
    documented = set()
    for flag_cell, default_cell, *_ in rows:
        flags = re.findall(r"(--[a-z][\w-]*)", flag_cell)
        assert flags and set(flags) <= options, flag_cell
        documented |= set(flags)
        if not default_cell or default_cell.startswith("from"):
            continue
        values = [v.strip() for v in default_cell.split(", ")]
        for flag, value in zip(flags, values):
            attr = flag[2:].replace("-", "_")
            if attr == "tier_weight":
                assert value.strip("`") == " ".join(f"{t}={w}" for t, w in DEFAULT_WEIGHTS.items())
            elif attr.startswith("admin_token"):
                assert value == "off" and cfg.admin_token is None
            else:
                got = _number(value.removesuffix(" s"))
                expect = getattr(cfg, attr)
                assert got == (float(expect) if isinstance(expect, (int, float)) else expect), (flag, value)
    assert documented == options - {"-h", "--help", "--log-level"}


def _kvslots_classes() -> set[str]:
    names = set()
    for path in PKG.rglob("*.py*"):
        if path.suffix in (".py", ".pyi"):
            names |= {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)}
    return names


def test_named_exception_classes_exist():
    known = _kvslots_classes() | {n for n in dir(builtins) if n.endswith("Error")}
    bad = []
    for doc in DOCS:
        for no, line in enumerate(doc.read_text().splitlines(), 1):
            bad += [f"{_rel(doc)}:{no}: {n}" for n in re.findall(r"\b([A-Z]\w*Error)\b", line) if n not in known]
    assert bad == []


@functools.cache
def _module_tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _defined(body: list[ast.stmt]) -> dict[str, ast.AST | None]:
    """Names a module or class body binds: to their node where it is a class, else None."""
    names: dict[str, ast.AST | None] = {}
    for node in body:
        if isinstance(node, ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = None
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update({(a.asname or a.name).split(".")[0]: None for a in node.names})
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update({n.id: None for n in ast.walk(target) if isinstance(n, ast.Name)})
        elif isinstance(node, (ast.If, ast.Try)):
            names.update(_defined(node.body))
            names.update(_defined(getattr(node, "orelse", [])))
            for handler in getattr(node, "handlers", []):
                names.update(_defined(handler.body))
    return names


def resolves(name: str) -> bool:
    """Whether ``kvslots.a.b.C.d`` names a module of the package and, past it, a name its
    source binds (a class's own attribute where the class is defined there)."""
    parts = name.split(".")
    path, i = PKG, 1
    while i < len(parts):
        if (path / parts[i] / "__init__.py").exists():
            path, i = path / parts[i], i + 1
        elif (path / f"{parts[i]}.py").exists() or (path / f"{parts[i]}.pyi").exists():
            path = next(p for p in (path / f"{parts[i]}.py", path / f"{parts[i]}.pyi") if p.exists())
            i += 1
            break
        else:
            break
    if path.is_dir():
        path = path / "__init__.py"
    body: list[ast.stmt] = _module_tree(path).body
    for part in parts[i:]:
        names = _defined(body)
        if part not in names:
            return False
        node = names[part]
        if not isinstance(node, ast.ClassDef):
            return True  # a function, a value or an import: what lies past it is not checked
        body = node.body
    return True


def test_kvslots_names_resolve():
    bad = []
    for doc in DOCS:
        for no, line in enumerate(doc.read_text().splitlines(), 1):
            for m in re.finditer(r"(?<![\w/-])kvslots(?:\.[A-Za-z_]\w*)+", line):
                if not resolves(m.group(0)):
                    bad.append(f"{_rel(doc)}:{no}: {m.group(0)}")
    assert bad == []
    assert not resolves("kvslots.config.connector.ConnectorConfig.no_such_method")
    assert not resolves("kvslots.indexer.app.NO_SUCH_BOUND")


def test_repository_paths_exist():
    """Every path under one of the repository's folders names a file or folder (or a prefix of
    some, as ``benches/results/pd_served_real_quiet.*``); a file a shown command writes (after
    ``--json``, ``--plot``, ``-o``) need not exist."""
    bad = []
    folders = "rust|python|tests|benches|scripts|docs|requirements|\\.ci"
    for doc in DOCS:
        for no, line in enumerate(doc.read_text().splitlines(), 1):
            for m in re.finditer(rf"(?<![\w/.-])((?:{folders})/[\w./*-]*[\w*])", line):
                if re.search(r"(--json|--plot|-o|>)\s*$", line[:m.start()]):
                    continue
                path = m.group(1).rstrip("*").rstrip(".")
                if not (ROOT / path).exists() and not list((ROOT / path).parent.glob(Path(path).name + "*")):
                    bad.append(f"{_rel(doc)}:{no}: {m.group(1)}")
    assert bad == []


def test_indexer_metric_names():
    from kvslots.indexer.metrics import Metrics

    metrics = Metrics()
    # the gauges the service reports (IndexerService._gauges, read at scrape time)
    source = (PKG / "indexer" / "service.py").read_text()
    gauges = re.findall(r'"(\w+)": ', source.split("def _gauges", 1)[1].split("\n\n", 1)[0])
    metrics.add_gauges(lambda: dict.fromkeys(gauges, 0))
    # a counter's family is named without its _total; one with labels has no sample yet
    exported = {family.name for family in metrics.registry.collect()}
    text = (ROOT / "docs" / "indexer.md").read_text()
    paragraph = text.split("`GET /metrics`", 1)[1].split("\n\n", 1)[0]
    named = [n for n in re.findall(r"`([a-z_]+)(?:\{[^`]*\})?`", paragraph) if n not in ("kvslots_indexer_", "worker")]
    assert len(named) >= 15
    missing = [n for n in named if f"kvslots_indexer_{n.removesuffix('_total')}" not in exported]
    assert missing == []


def unknown_bench_options(text: str) -> list[str]:
    """Every option after ``benches/NAME.py`` in one code unit that the script's source never
    spells as a quoted option string (its argparse definitions)."""
    bad = []
    for no, unit in code_units(text):
        for m in re.finditer(r"(benches/[\w/]+\.py)", unit):
            source = ROOT / m.group(1)
            if not source.exists():
                bad.append(f"{no}: no {m.group(1)}")
                continue
            options = set(re.findall(r"""["'](--?[\w-]+)["']""", source.read_text()))
            rest = re.split(r"\s(?:&&|;|\|)\s|benches/", unit[m.end():])[0]
            bad += [f"{no}: {m.group(1)} has no {o}" for o in re.findall(r"(?<![\w./=-])(--?[A-Za-z][\w-]*)", rest)
                    if o not in options]
    return bad


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_bench_command_lines_use_existing_options(doc):
    assert unknown_bench_options(doc.read_text()) == []


def test_a_planted_wrong_bench_option_is_found():
    assert unknown_bench_options("`python benches/bench_slots.py --batch 64 --repeat 3`")
    assert unknown_bench_options("`python benches/bench_slots.py --batch 64 --repeats 3`") == []


def test_named_tests_exist():
    """Every ``test_...`` the docs name is a file in tests/ or a test function there."""
    sources = "\n".join(p.read_text() for p in (ROOT / "tests").glob("*.py"))
    defined = set(re.findall(r"^\s*(?:async\s+)?def (test_\w+)", sources, re.M))
    bad = []
    for doc in DOCS:
        for no, line in enumerate(doc.read_text().splitlines(), 1):
            bad += [f"{_rel(doc)}:{no}: {name}" for name in re.findall(r"(?<![\w/])(test_\w+)(?!\w*/)", line)
                    if name not in defined and not (ROOT / "tests" / f"{name}.py").exists()]
    assert bad == []


def _anchors(text: str) -> set[str]:
    """GitHub's anchors of a page's headings (lower case, punctuation dropped, spaces as -)."""
    found, fenced = set(), False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#+\s+(.*)", line)):
            found.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return found


def broken_links(doc: Path, text: str) -> list[str]:
    bad = []
    for no, line in enumerate(text.splitlines(), 1):
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, fragment = target.partition("#")
            page = doc.parent / path if path else doc
            if not page.exists():
                bad.append(f"{no}: no {target}")
            elif fragment and page.suffix == ".md":
                if fragment not in _anchors(text if page == doc else page.read_text()):
                    bad.append(f"{no}: no heading for {target}")
    return bad


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_links_resolve(doc):
    assert broken_links(doc, doc.read_text()) == []


def test_a_planted_broken_link_is_found():
    doc = ROOT / "docs" / "serve.md"
    assert broken_links(doc, "see [x](indexer.md#eagle-worker)") == ["1: no heading for indexer.md#eagle-worker"]
    assert broken_links(doc, "see [x](index.md)") == ["1: no index.md"]
    assert broken_links(doc, "## KV events\nsee [x](indexer.md#eagle-workers) and [y](#kv-events)") == []
    assert broken_links(doc, "## KV events\nsee [y](#kv-event)") == ["2: no heading for #kv-event"]
