"""The fields of vLLM's own config dataclasses and their types, read from the installed vLLM's
source without importing vLLM, so that a dict kvslots gives vLLM (``--speculative-config``) is
checked by vLLM's own rules before vLLM starts.

vLLM 0.32 builds ``SpeculativeConfig(**speculative_config)`` only once its engine starts: a key
of the wrong type (``"disable_eagle_block_drop": [1]``) or an unknown one was a pydantic
ValidationError there, after start-up. Importing ``vllm.config`` to ask it takes about ten
seconds (torch and the model registry); parsing its source with :mod:`ast` takes milliseconds.
So vLLM stays the one home of the rules: each field's annotation (and its ``Field(ge=..., gt=...)``
bounds) is read from the dataclass in ``vllm/config/*.py``, type aliases followed into the
modules they come from (``Literal`` lists such as ``SpeculativeMethod``, ``CacheDType``), and the
value is validated with pydantic's ``TypeAdapter``, in the lax mode vLLM's config uses.

What this reader cannot turn into a type (a class such as ``LoadConfig``, an enum, a field with a
``mode="before"`` validator that changes its input) is left unchecked: vLLM judges it itself. So
is everything when vLLM is not installed or its source has changed beyond reading
(:func:`dataclass_fields` returns None).
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib.util
import os
import typing
from dataclasses import dataclass
from typing import Any

#: Read no module source larger than this (vLLM's largest config module is ~100 KB).
_MAX_SOURCE_BYTES = 4 << 20
#: How many aliases deep an annotation is followed (SpeculativeMethod -> EagleModelTypes -> ...).
_MAX_DEPTH = 16

_BUILTIN_TYPES = {name: getattr(builtins, name) for name in
                  ("bool", "int", "float", "str", "bytes", "list", "dict", "tuple", "set", "frozenset")}
_TYPING = {"Any": Any, "Literal": typing.Literal, "Optional": typing.Optional, "Union": typing.Union,
           "Annotated": typing.Annotated, "List": list, "Dict": dict, "Tuple": tuple, "Set": set}
_CONSTRAINTS = ("gt", "ge", "lt", "le", "min_length", "max_length", "multiple_of")


class _Unknown(Exception):
    """An annotation this reader does not turn into a type."""


@dataclass(frozen=True)
class _Module:
    name: str
    tree: ast.Module
    #: name -> its first module-level binding: ("assign", the expression), ("import", (module,
    #: attribute or None for the module itself)) or ("class", the ClassDef)
    names: dict[str, tuple[str, Any]]


class FieldRule:
    """One field of a vLLM config dataclass: its annotation as written, its ``Field`` bounds, and
    (read on first use) the type pydantic validates it with, :attr:`kind` (None: not checked
    here)."""

    def __init__(self, name: str, node: ast.expr | None, module: _Module | None, bounds: dict[str, Any]):
        self.name = name
        self.annotation = ast.unparse(node) if node is not None else "?"
        self.bounds = bounds
        self._node = node
        self._module = module
        self._kind: Any = _UNREAD
        self._adapter: Any = _UNREAD

    @property
    def kind(self) -> Any:
        if self._kind is _UNREAD:
            kind: Any = None
            if self._node is not None and self._module is not None:
                try:
                    kind = _eval(self._node, self._module, 0)
                except (_Unknown, TypeError, RecursionError):
                    kind = None
            self._kind = None if kind is Any else kind
        return self._kind

    def adapter(self) -> Any:
        """pydantic's TypeAdapter for :attr:`kind` with the bounds (made once); None when there
        is no kind, or pydantic builds no schema for it (left to vLLM)."""
        if self._adapter is _UNREAD:
            self._adapter = None
            if self.kind is not None:
                from pydantic import Field, TypeAdapter

                kind: Any = typing.Annotated[self.kind, Field(**self.bounds)] if self.bounds else self.kind
                try:
                    self._adapter = TypeAdapter(kind)
                except Exception:
                    self._adapter = None
        return self._adapter

    def __repr__(self) -> str:
        return f"FieldRule({self.name!r}, {self.annotation!r}, bounds={self.bounds})"


_UNREAD = object()


@functools.lru_cache(maxsize=1)
def _vllm_root() -> str | None:
    """The directory of the installed ``vllm`` package, found without importing it."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return locations[0] if locations else None


@functools.lru_cache(maxsize=64)
def _module(name: str) -> _Module | None:
    """vLLM module ``name`` (``vllm.config.speculative``) parsed, or None (not there, not
    readable, not Python this interpreter parses)."""
    root = _vllm_root()
    parts = name.split(".")
    if root is None or parts[0] != "vllm":
        return None
    base = os.path.join(root, *parts[1:])
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        try:
            with open(path, "rb") as f:
                source = f.read(_MAX_SOURCE_BYTES + 1)
        except OSError:
            continue
        if len(source) > _MAX_SOURCE_BYTES:
            return None
        try:
            tree = ast.parse(source, path)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return None
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        names: dict[str, tuple[str, Any]] = {}
        _collect(tree.body, package, names)
        return _Module(name, tree, names)
    return None


def _collect(body: list[ast.stmt], package: str, names: dict[str, tuple[str, Any]]) -> None:
    """The module-level names of ``body``, ``if TYPE_CHECKING:`` and ``try:`` blocks included
    (the first binding of a name wins: the typing branch comes first in vLLM's modules)."""
    for stmt in body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            names.setdefault(stmt.targets[0].id, ("assign", stmt.value))
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
            names.setdefault(stmt.target.id, ("assign", stmt.value))
        elif isinstance(stmt, ast.ClassDef):
            names.setdefault(stmt.name, ("class", stmt))
        elif isinstance(stmt, ast.Import):
            for a in stmt.names:
                if a.asname:
                    names.setdefault(a.asname, ("import", (a.name, None)))
                else:
                    head = a.name.split(".")[0]
                    names.setdefault(head, ("import", (head, None)))
        elif isinstance(stmt, ast.ImportFrom):
            module = stmt.module or ""
            if stmt.level:
                up = package.split(".")
                up = up[: len(up) - (stmt.level - 1)] if stmt.level > 1 else up
                module = ".".join([*up, module] if module else up)
            for a in stmt.names:
                names.setdefault(a.asname or a.name, ("import", (module, a.name)))
        elif isinstance(stmt, ast.If):
            _collect(stmt.body, package, names)
            _collect(stmt.orelse, package, names)
        elif isinstance(stmt, ast.Try):
            _collect(stmt.body, package, names)


_SKIP = object()  # pydantic's SkipValidation: any value


def _symbol(module: str, attr: str, depth: int) -> Any:
    """What ``from module import attr`` names, as a type or special form."""
    if module in ("typing", "typing_extensions"):
        if attr in _TYPING:
            return _TYPING[attr]
        raise _Unknown(attr)
    if module == "pydantic" and attr == "SkipValidation":
        return _SKIP
    mod = _module(module)
    if mod is None:
        # ``from vllm.x import y`` where y is the module vllm.x.y
        if _module(f"{module}.{attr}") is not None:
            return ("module", f"{module}.{attr}")
        raise _Unknown(f"{module}.{attr}")
    return _name(mod, attr, depth + 1)


def _name(mod: _Module, name: str, depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise _Unknown(name)
    how, what = mod.names.get(name, ("", None))
    if how == "assign":
        return _eval(what, mod, depth + 1)
    if how == "class":
        raise _Unknown(name)  # a dataclass, an enum: vLLM's own validation
    if how == "import":
        module, attr = what
        if attr is None:
            return ("module", module)
        return _symbol(module, attr, depth)
    if name in _BUILTIN_TYPES:
        return _BUILTIN_TYPES[name]
    if name == "None":
        return type(None)
    raise _Unknown(name)


def _eval(node: ast.expr, mod: _Module, depth: int) -> Any:
    """The type an annotation expression names; :class:`_Unknown` where this reader stops."""
    if depth > _MAX_DEPTH:
        raise _Unknown(ast.dump(node))
    if isinstance(node, ast.Constant):
        if node.value is None:
            return type(None)
        if isinstance(node.value, str):  # a forward reference
            try:
                inner = ast.parse(node.value, mode="eval").body
            except SyntaxError:
                raise _Unknown(node.value) from None
            return _eval(inner, mod, depth + 1)
        raise _Unknown(repr(node.value))
    if isinstance(node, ast.Name):
        return _name(mod, node.id, depth)
    if isinstance(node, ast.Attribute):
        base = _eval(node.value, mod, depth + 1)
        if isinstance(base, tuple) and base[0] == "module":
            return _symbol(base[1], node.attr, depth)
        raise _Unknown(node.attr)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return typing.Union[_eval(node.left, mod, depth + 1), _eval(node.right, mod, depth + 1)]
    if isinstance(node, ast.Subscript):
        head = _eval(node.value, mod, depth + 1)
        items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if head is typing.Literal:
            values: list[Any] = []
            for item in items:
                if isinstance(item, ast.Constant) and isinstance(item.value, (str, int, bool, bytes)):
                    values.append(item.value)
                    continue
                inner = _eval(item, mod, depth + 1)  # another Literal alias
                if typing.get_origin(inner) is not typing.Literal:
                    raise _Unknown("Literal")
                values.extend(typing.get_args(inner))
            return typing.Literal[tuple(values)]
        if head is _SKIP:
            return Any
        if head is typing.Annotated:
            return _eval(items[0], mod, depth + 1)
        if head is tuple and len(items) == 2 and isinstance(items[1], ast.Constant) and items[1].value is Ellipsis:
            return tuple[_eval(items[0], mod, depth + 1), ...]  # type: ignore[misc]
        args = tuple(_eval(item, mod, depth + 1) for item in items)
        if head is typing.Optional and len(args) == 1:
            return typing.Optional[args[0]]
        if head is typing.Union:
            return typing.Union[args]
        if head in (list, set, frozenset) and len(args) == 1:
            return head[args[0]]
        if head is dict and len(args) == 2:
            return dict[args[0], args[1]]  # type: ignore[valid-type, misc]
        if head is tuple:
            return tuple[args]  # type: ignore[valid-type, misc]
        raise _Unknown(ast.dump(node.value))
    raise _Unknown(type(node).__name__)


def _decorator_name(node: ast.expr) -> str:
    target = node.func if isinstance(node, ast.Call) else node
    return target.id if isinstance(target, ast.Name) else target.attr if isinstance(target, ast.Attribute) else ""


def _validated_before(cls: ast.ClassDef) -> tuple[set[str], bool]:
    """(fields with a before/wrap/plain validator, whether a before/wrap model validator exists):
    vLLM changes those inputs before their types are checked."""
    fields: set[str] = set()
    model_before = False
    for stmt in cls.body:
        if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for dec in stmt.decorator_list:
            name = _decorator_name(dec)
            if not isinstance(dec, ast.Call) or name not in ("field_validator", "model_validator"):
                continue
            mode = next((k.value.value for k in dec.keywords if k.arg == "mode" and isinstance(k.value, ast.Constant)),
                        "after")
            if mode == "after":
                continue
            if name == "model_validator":
                model_before = True
            else:
                fields.update(a.value for a in dec.args if isinstance(a, ast.Constant) and isinstance(a.value, str))
    return fields, model_before


def _constraints(value: ast.expr | None) -> dict[str, Any] | None:
    """The numeric bounds of a ``Field(...)`` default (None: not a Field call); ``init=False``
    fields are no keyword arguments and are left out by the caller."""
    if not (isinstance(value, ast.Call) and _decorator_name(value) in ("Field", "field")):
        return None
    found: dict[str, Any] = {}
    for k in value.keywords:
        if k.arg == "init" and isinstance(k.value, ast.Constant) and k.value.value is False:
            found["init"] = False
        elif k.arg in _CONSTRAINTS and isinstance(k.value, ast.Constant) and isinstance(k.value.value, (int, float)) \
                and not isinstance(k.value.value, bool):
            found[k.arg] = k.value.value
    return found


@functools.lru_cache(maxsize=8)
def dataclass_fields(module: str, cls_name: str) -> dict[str, FieldRule] | None:
    """The keyword arguments vLLM's config dataclass ``module.cls_name`` takes, each with its
    type (a :class:`FieldRule` whose ``kind`` is None when it is left to vLLM). None when vLLM
    is not installed, the class is not found as expected (a base class, a ``config=`` of its
    own that may allow extra keys, a ``mode="before"`` model validator), or its source cannot
    be read: then nothing is checked here."""
    mod = _module(module)
    if mod is None:
        return None
    how, cls = mod.names.get(cls_name, ("", None))
    if how != "class" or cls.bases or cls.keywords:
        return None
    decorators = [_decorator_name(d) for d in cls.decorator_list]
    if decorators != ["config"] or isinstance(cls.decorator_list[0], ast.Call):
        return None  # only vLLM's plain @config is known to forbid extra keys
    before, model_before = _validated_before(cls)
    if model_before:
        return None
    fields: dict[str, FieldRule] = {}
    for stmt in cls.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        name = stmt.target.id
        if "ClassVar" in ast.unparse(stmt.annotation) or "InitVar" in ast.unparse(stmt.annotation):
            continue
        bounds = _constraints(stmt.value)
        if bounds is not None and bounds.pop("init", True) is False:
            continue
        checked = name not in before
        fields[name] = FieldRule(name, stmt.annotation if checked else None, mod if checked else None, bounds or {})
    return fields


def validate_field(rule: FieldRule, value: Any) -> tuple[Any, str, str | None]:
    """(the value as vLLM reads it, "", None), or (value, where inside it, what is wrong): the
    position as indexes (``[0][1]``) and pydantic's message (one per failing member of a union
    is summed up as one line).

    A value of exactly the field's plain type (a str for ``str | None``, a listed str for a
    ``Literal``, an int within the bounds for ``int``) passes without pydantic, which is then
    not even imported (about 0.2 s); anything else pydantic judges."""
    kind = rule.kind
    if kind is None:
        return value, "", None
    if _plainly_valid(kind, value) and _within(rule.bounds, value):
        return value, "", None
    adapter = rule.adapter()
    if adapter is None:
        return value, "", None
    from pydantic import ValidationError

    try:
        return adapter.validate_python(value), "", None
    except ValidationError as e:
        errors = e.errors(include_url=False)
    # Positions inside lists and tuples; a union member's name in the position is left out.
    where = "".join(f"[{p}]" for p in errors[0].get("loc", ()) if isinstance(p, int))
    msgs = list(dict.fromkeys(str(err.get("msg", "invalid")) for err in errors))
    msg = msgs[0] if len(msgs) == 1 else "Input should match one of the types"
    if len(msg) > _MAX_MESSAGE:
        msg = msg[: _MAX_MESSAGE - 3] + "..."
    return value, where, msg


def _plainly_valid(kind: Any, value: Any) -> bool:
    """Whether ``value`` is exactly of the plain type ``kind`` names (no conversion pydantic
    could make or refuse): a shortcut, never a verdict against the value."""
    if kind in (bool, int, float, str):
        return type(value) is kind
    if kind is type(None):
        return value is None
    origin = typing.get_origin(kind)
    if origin is typing.Literal:
        return type(value) is str and all(type(a) is str for a in typing.get_args(kind)) \
            and value in typing.get_args(kind)
    if origin is typing.Union:
        return any(_plainly_valid(member, value) for member in typing.get_args(kind))
    return False


def _within(bounds: dict[str, Any], value: Any) -> bool:
    """Whether a plainly valid ``value`` meets the numeric ``Field`` bounds (None and text have
    none to meet; any other bound is pydantic's to judge)."""
    if not bounds or value is None:
        return True
    if type(value) not in (int, float) or set(bounds) - {"gt", "ge", "lt", "le"}:
        return False
    return all({"gt": value > b, "ge": value >= b, "lt": value < b, "le": value <= b}[k] for k, b in bounds.items())


#: pydantic lists every choice of a Literal (40 speculative methods): cut to one readable line.
_MAX_MESSAGE = 400


__all__ = ["FieldRule", "dataclass_fields", "validate_field"]
