"""Reading a configuration file kvslots is given a path to (a TRT-LLM engine YAML, the indexer's
``--config`` YAML, a model's or speculators checkpoint's config.json): the one home of the limits
and the strictness rules.

Reading (:func:`read_config_text`): only a regular file (a directory, FIFO, device or socket is
refused before anything is read, so ``/dev/zero`` or a FIFO cannot hang), at most
:data:`MAX_BYTES`, UTF-8 (a leading BOM is dropped).

Parsing (:func:`parse_yaml`, :func:`parse_json`): the JSON data model only (mappings, lists,
strings, numbers, booleans, null), and

* at most :data:`MAX_DEPTH` levels of nesting;
* YAML: at most :data:`MAX_NODES` nodes with every alias expanded (a "billion laughs" alias bomb
  is refused while it is read, in microseconds, not when it is later walked or written out), and
  no alias inside the node it names (a recursive structure);
* at most :data:`MAX_TEXT_CHARS` characters of keys and strings, a YAML alias counting the text
  it repeats (what a file of :data:`MAX_BYTES` holds without aliases: one 1 MB string named by
  1,000 aliases is 1 GB once written out);
* mapping keys are scalars (a list or mapping as a key is refused) of at most
  :data:`MAX_KEY_CHARS` characters, given once (a key given twice is an error naming its line;
  a key merged in with YAML's ``<<`` may be overridden);
* numbers are finite (``.nan``, ``.inf``, ``1e999``, JSON's ``NaN`` are refused naming the
  field) and integers fit in 64 bits;
* YAML dates stay strings; ``!!binary``, ``!!set``, ``!!omap``, ``!!pairs`` and
  ``!!timestamp`` are refused.

Every failure is a :class:`~kvslots.ConfigError` whose ``source`` is the file.
:func:`dump_json` writes JSON that never contains a bare ``NaN`` or ``Infinity``.
"""

from __future__ import annotations

import builtins
import json
import math
import os
import re
import reprlib
import stat
from collections.abc import Mapping
from itertools import accumulate, islice
from typing import Any

from .._args import integer
from ..errors import ArgumentTypeError, ConfigError

#: Largest configuration file read, in bytes.
MAX_BYTES = 4 * 1024 * 1024
#: Deepest nesting of mappings and lists.
MAX_DEPTH = 64
#: Most nodes (scalars, lists, mappings) in a document, YAML aliases expanded.
MAX_NODES = 100_000
#: Most nodes of an engine's configuration (a TRT-LLM engine YAML, vLLM's ``--config`` file):
#: most hold a few hundred, but a wide-EP one lists its MoE load balancer's initial slot
#: assignments inline (DeepSeek-V3: 58 layers of 288 slots, 16.7k nodes; a 61-layer model of
#: 384 slots 23k). Reading and converting MAX_NODES of them took 3-4 s.
MAX_ENGINE_NODES = 50_000
#: Longest mapping key, in characters.
MAX_KEY_CHARS = 1024
#: Most characters of keys and strings in a document, every repeat of a value counted: no file
#: of MAX_BYTES holds more without YAML aliases.
MAX_TEXT_CHARS = MAX_BYTES
#: Integers are 64-bit signed.
INT_MIN, INT_MAX = -(2**63), 2**63 - 1

_TAG = "tag:yaml.org,2002:"
#: Most parts of a YAML 1.1 base-60 number (``1:30``); 60**63 is far past a 64-bit integer.
_MAX_BASE60_PARTS = 64
_REFUSED_TAGS = ("binary", "set", "omap", "pairs", "timestamp")


def yaml_module() -> Any:
    """PyYAML (a dependency), or a ConfigError saying how to install it."""
    try:
        import yaml
    except ImportError as e:  # pragma: no cover - pyyaml is a dependency
        raise ConfigError("PyYAML is needed to read or write YAML (pip install pyyaml)") from e
    return yaml


def clip(text: str, limit: int = 200) -> str:
    """``text`` cut to ``limit`` characters for a message (a parser's own message may quote a
    whole tag or alias name from the file: megabytes)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Brief(reprlib.Repr):
    """``repr`` of at most about ``limit`` characters' worth of a value: the same text as
    ``repr`` for a value whose repr is no longer, and for a longer one the same first ``limit``
    characters (containers past ``limit`` items or levels and strings past ``2 * limit``
    characters are not read further: a list nested 100,000 deep was a RecursionError, a list of
    10**8 items a repr of 300 MB)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.maxlevel = self.maxtuple = self.maxlist = self.maxarray = self.maxdict = limit
        self.maxset = self.maxfrozenset = self.maxdeque = limit
        self.maxstring = self.maxlong = self.maxother = 2 * limit

    def repr_str(self, x: str, level: int) -> str:
        return builtins.repr(x[: self.maxstring])  # a longer one is cut by brief

    def repr_int(self, x: int, level: int) -> str:
        try:
            return builtins.repr(x)
        except ValueError:  # more digits than int -> str converts
            return f"<int of {x.bit_length()} bits>"

    def repr_instance(self, x: Any, level: int) -> str:
        return builtins.repr(x)  # what it raises is brief's to handle (reprlib made up a text)

    def repr_dict(self, x: dict[Any, Any], level: int) -> str:
        # In the dict's own order, as repr (reprlib sorts the keys).
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        pieces = [f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}"
                  for k, v in islice(dict.items(x), self.maxdict)]
        if len(x) > self.maxdict:
            pieces.append("...")
        return "{" + ", ".join(pieces) + "}"


class _BriefPlain(_Brief):
    """:class:`_Brief` in the form a YAML file or a command line writes a value: JSON's
    ``true``/``null``/``"text"`` inside containers, a list for a tuple."""

    def repr_str(self, x: str, level: int) -> str:
        return json.dumps(x[: self.maxstring])

    def repr_bool(self, x: bool, level: int) -> str:
        return "true" if x else "false"

    def repr_NoneType(self, x: None, level: int) -> str:
        return "null"

    def repr_tuple(self, x: tuple[Any, ...], level: int) -> str:
        return self.repr_list(list(islice(x, self.maxlist + 1)), level)


_BRIEF: dict[tuple[int, bool], _Brief] = {}


def brief(value: Any, limit: int = 60, *, plain: bool = False) -> str:
    """``repr(value)``, shortened for a message: never more than ``limit`` characters, at a
    cost bounded by ``limit`` whatever the value (:class:`_Brief`); the type's name when even
    that cannot be had (a ``__repr__`` that raises). The one home of quoting a value in a
    message. ``plain``: a value as the user wrote it in a YAML file or on a command line
    instead (a str as it is, ``true``, ``null``, ``{"k": [1]}``)."""
    if plain and type(value) is str:
        text = value[: limit + 1]
    else:
        key = (limit, plain)
        try:
            text = (_BRIEF.get(key) or _BRIEF.setdefault(key, (_BriefPlain if plain else _Brief)(limit))).repr(value)
        except Exception:  # RecursionError included
            return f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------- reading

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def read_config_text(path: str | os.PathLike[str], *, max_bytes: int = MAX_BYTES) -> str:
    """The text of the regular file ``path`` (at most ``max_bytes``, UTF-8). Raises
    :class:`ConfigError` with ``source`` the path: ``no such file``, ``is a directory``, ``not a
    regular file (a FIFO)``, ``permission denied``, ``larger than ...``, ``not UTF-8 ...``."""
    try:
        name = os.fspath(path)
    except Exception:  # TypeError, or whatever a PathLike's own __fspath__ raises
        raise ArgumentTypeError(f"a file path must be a str, bytes or os.PathLike, got {type(path).__name__}") from None
    source = name if isinstance(name, str) else os.fsdecode(name)
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:  # "x" was a TypeError
        raise ArgumentTypeError(f"max_bytes must be an int >= 0, got {type(max_bytes).__name__} {brief(max_bytes)}")
    if not source:  # an option given as "" (--config ""): say so, not "no such file" of no name
        raise ConfigError("an empty path names no file")
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(name, flags)  # O_NONBLOCK: opening a FIFO with no writer does not wait
    except FileNotFoundError:
        raise ConfigError("no such file", None, source) from None
    except IsADirectoryError:
        raise ConfigError("is a directory, not a file", None, source) from None
    except PermissionError:
        raise ConfigError("cannot read: permission denied", None, source) from None
    except UnicodeEncodeError:  # '\ud800': the codec's own message named a position and a codec
        raise ConfigError("cannot read: a lone surrogate, which no file name holds, in the path", None, source) from None
    except (OSError, ValueError) as e:  # ValueError: a NUL in the name
        raise ConfigError(f"cannot read: {getattr(e, 'strerror', None) or e}", None, source) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = next((what for test, what in _KINDS if test(st.st_mode)), "not a plain file")
            if kind == "a directory":
                raise ConfigError("is a directory, not a file", None, source)
            raise ConfigError(f"not a regular file ({kind})", None, source)
        too_large = ConfigError(f"larger than {_size(max_bytes)}, the most kvslots reads", None, source)
        if st.st_size > max_bytes:
            raise too_large
        chunks: list[bytes] = []
        total = 0
        while True:
            chunk = os.read(fd, min(1 << 16, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:  # grew while read, or a /proc-like file with no size
                raise too_large
    except OSError as e:
        raise ConfigError(f"cannot read: {e.strerror or e}", None, source) from None
    finally:
        os.close(fd)
    return _utf8_text(b"".join(chunks), source)


def _utf8_text(data: bytes, source: str | None) -> str:
    """``data`` decoded as UTF-8, a leading BOM dropped; a :class:`ConfigError` naming the first
    byte that is not UTF-8 otherwise (a file's rule, and YAML given as bytes)."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})", None, source
        ) from None


def _size(n: int) -> str:
    return f"{n // (1024 * 1024)} MiB" if n >= 1024 * 1024 and n % (1024 * 1024) == 0 else f"{n} bytes"


# --------------------------------------------------------------------------- checking values


def check_values(doc: Any, source: str | None = None, *, max_depth: int = MAX_DEPTH,
                 max_nodes: int = MAX_NODES) -> Any:
    """Walks a loaded document (without recursion) and raises :class:`ConfigError`, naming the
    field, for a non-finite number, an integer beyond 64 bits, a key longer than
    :data:`MAX_KEY_CHARS`, nesting deeper than ``max_depth``, more than ``max_nodes`` values or
    more than :data:`MAX_TEXT_CHARS` characters of keys and strings (a value that appears more
    than once, as a YAML alias makes it, counted each time). Types other than the JSON ones are
    refused too.

    Returns the document as plain data: dicts, lists, and exact ``str``, ``int``, ``float``,
    ``bool`` and ``None``, so that a mapping given in code is read once, here. What its own
    methods raise while it is read (a Mapping's ``items``, a key's ``__hash__``, an ``int``
    subclass's comparisons) is a ConfigError naming the field, and code after the check never
    calls a subclass's overrides. A key given twice once made plain text is an error too."""
    max_depth = integer(max_depth, "max_depth", 0)
    max_nodes = integer(max_nodes, "max_nodes", 0)
    root: list[Any] = [None]
    # Entries: (plain value, parent entry, the key or index in it, depth) for paths, which are
    # only spelled out for an error (spelling every path would cost depth x key length per
    # value); the stack holds (value as given, parent entry, key, depth, container, slot).
    stack: list[tuple[Any, Any, Any, int, Any, Any]] = [(doc, None, None, 0, root, 0)]
    count = 0
    chars = 0  # of keys and strings: the nodes' count alone let aliases of one long string through
    while stack:
        value, parent, key, depth, container, slot = stack.pop()
        count += 1
        if count > max_nodes:
            raise ConfigError(f"more than {max_nodes} values; not a configuration file", None, source)
        try:
            plain, problem = _plain_scalar(value)
        except Exception as e:  # an int or float subclass whose own methods raise
            plain, problem = None, f"cannot be read ({type(e).__name__})"
        if problem:
            raise ConfigError(problem, _path((None, parent, key, depth)), source)
        if plain is not _NOT_SCALAR:
            if isinstance(plain, str):
                chars += len(plain)
                if chars > MAX_TEXT_CHARS:
                    raise _too_much_text(_path((None, parent, key, depth)), source)
            container[slot] = plain
            continue
        if not isinstance(value, (Mapping, list)):
            raise ConfigError(f"a {type(value).__name__} is not a configuration value",
                              _path((None, parent, key, depth)), source)
        if depth >= max_depth:
            raise ConfigError(f"nested more than {max_depth} levels deep", _path((None, parent, key, depth)), source)
        if isinstance(value, list):
            # Every item and every entry still on the stack is a value yet to count: past the
            # limit now, not once a child entry was made per item (a config.json list of 1.9M
            # numbers took 4 s and 360 MB to refuse, read twice by kvslots serve).
            if count + len(stack) + list.__len__(value) > max_nodes:
                raise ConfigError(f"more than {max_nodes} values; not a configuration file", None, source)
            items = list.copy(value)  # the list's own items: a subclass's __iter__ is not called
            out: Any = [None] * len(items)
            entry = (out, parent, key, depth)
            children = [(item, entry, i, depth + 1, out, i) for i, item in enumerate(items)]
        else:
            out = {}
            entry = (out, parent, key, depth)
            pairs: Any
            try:
                if type(value) is dict and count + len(stack) + len(value) > max_nodes:
                    pairs = value  # past the limit: refused below, before 10**6 pairs are copied
                else:
                    pairs = list(value.items())
            except Exception as e:
                raise ConfigError(f"cannot be read as a mapping (reading it raised {type(e).__name__})",
                                  _path(entry), source) from None
            if count + len(stack) + len(pairs) > max_nodes:  # as for a list
                raise ConfigError(f"more than {max_nodes} values; not a configuration file", None, source)
            children = []
            for k, item in pairs:
                try:
                    plain_key, key_problem = _plain_scalar(k)
                except Exception as e:
                    plain_key, key_problem = None, f"cannot be read ({type(e).__name__})"
                if key_problem is None and plain_key is _NOT_SCALAR:
                    key_problem = "not a scalar"
                if key_problem is None and isinstance(plain_key, str) and len(plain_key) > MAX_KEY_CHARS:
                    key_problem = f"longer than {MAX_KEY_CHARS} characters"
                if key_problem is None and plain_key in out:  # two str subclass keys of one text
                    key_problem = "given twice"
                if key_problem:
                    raise ConfigError(f"key {brief(k)}: {key_problem}", _path(entry), source)
                if isinstance(plain_key, str):
                    chars += len(plain_key)
                    if chars > MAX_TEXT_CHARS:
                        raise _too_much_text(_path(entry), source)
                out[plain_key] = None
                children.append((item, entry, plain_key, depth + 1, out, plain_key))
        container[slot] = out
        stack.extend(reversed(children))
    return root[0]


#: :func:`_plain_scalar`'s answer for a value that is no scalar.
_NOT_SCALAR = object()


def _plain_scalar(value: Any) -> tuple[Any, str | None]:
    """(the scalar as its exact built-in type, or :data:`_NOT_SCALAR`; the problem with it or None)."""
    if value is None or value is True or value is False:
        return value, None
    if isinstance(value, str):
        return str.__str__(value), None
    if isinstance(value, int):
        plain = int.__index__(value)  # the int's own value, not an override's
        return plain, _scalar_problem(plain)
    if isinstance(value, float):
        real = float.__float__(value)
        return real, _scalar_problem(real)
    return _NOT_SCALAR, None


def _too_much_text(field: str | None, source: str | None) -> ConfigError:
    return ConfigError(f"more than {MAX_TEXT_CHARS} characters of keys and strings (a YAML alias counts "
                       "the text it repeats); not a configuration file", field, source)


def _path(entry: tuple[Any, Any, Any, int]) -> str | None:
    """The dotted path (``a.b[2].c``) of a :func:`check_values` entry; ``None`` for the root."""
    parts: list[str] = []
    while entry[1] is not None:
        key = entry[2]
        parent_is_list = isinstance(entry[1][0], list)
        text = f"[{key}]" if parent_is_list else str(key)
        if len(text) > 60:
            text = text[:57] + "..."
        parts.append(text if parent_is_list or entry[1][1] is None else "." + text)
        entry = entry[1]
    return "".join(reversed(parts)) or None


def _scalar_problem(value: Any) -> str | None:
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number, got {value}"
    if isinstance(value, int) and not isinstance(value, bool) and not INT_MIN <= value <= INT_MAX:
        return "integer out of range (a signed 64-bit integer, -2**63 .. 2**63-1)"
    return None


def text_problem(value: str) -> str | None:
    """What keeps the str ``value`` from being passed on as text (a command-line argument, a path,
    JSON on stdout), ``None`` when nothing does: a NUL (no argv or path holds one) or a lone
    surrogate (no UTF-8 holds one). The one home of that rule for configuration strings."""
    if "\0" in value:
        return "must not contain a NUL character"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "must be valid Unicode (no lone surrogates)"
    return None


def expand_home(path: str) -> str:
    """``path`` with a leading ``~`` or ``~user`` expanded, the one home of that rule for the
    paths a configuration gives (a model directory, the disk tier's ``disk_path``): what it names
    is read by vLLM or a worker, which take ``~`` literally, and JSON on a command line is never
    expanded by a shell. A ``~`` that cannot be expanded (a user there is not, a NUL) stays as
    written: it then names nothing, like any other path that does not exist."""
    try:
        return os.path.expanduser(path)
    except ValueError:  # a NUL (getpwnam's ValueError); no such user returns the path as given
        return path


# --------------------------------------------------------------------------- YAML


class _Refused(Exception):
    """A limit or rule of this module, raised while parsing; becomes a ConfigError."""

    def __init__(self, problem: str, mark: Any = None):
        super().__init__(problem)
        self.problem = problem
        self.mark = mark

    def text(self) -> str:
        return self.problem + (f" at line {self.mark.line + 1}" if self.mark is not None else "")


_LOADER: Any = None


def _loader_class() -> Any:
    global _LOADER
    if _LOADER is not None:
        return _LOADER
    yaml_module()  # a ConfigError saying how to install PyYAML when it is missing
    from yaml.composer import Composer
    from yaml.constructor import SafeConstructor
    from yaml.events import AliasEvent, ScalarEvent
    from yaml.nodes import MappingNode, ScalarNode, SequenceNode
    from yaml.resolver import Resolver

    class _Resolver(Resolver):
        """YAML 1.1's implicit types less timestamps (a date stays a string)."""

    _Resolver.yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag != _TAG + "timestamp"]
        for first, resolvers in Resolver.yaml_implicit_resolvers.items()
    }

    class _Composer(Composer):
        """Counts nodes (an alias counts as the nodes it names) and nesting while composing."""

        def __init__(self) -> None:
            super().__init__()
            self.kv_nodes = 0
            self.kv_depth = 0
            self.kv_sizes: dict[str, int] = {}
            self.kv_max_nodes = MAX_NODES
            self.kv_aliased = False  # an alias counted: the limit may be an alias bomb's

        def kv_count(self, n: int, mark: Any) -> None:
            self.kv_nodes += n
            if self.kv_nodes > self.kv_max_nodes:
                if not self.kv_aliased:  # a plain file that large was called "an alias bomb?"
                    raise _Refused(f"more than {self.kv_max_nodes} nodes; not a configuration file", mark)
                raise _Refused(f"more than {self.kv_max_nodes} nodes with aliases expanded "
                               "(an alias bomb?)", mark)

        def compose_node(self, parent: Any, index: Any) -> Any:
            event = self.peek_event()
            if isinstance(event, AliasEvent):
                if event.anchor in self.anchors:
                    size = self.kv_sizes.get(event.anchor)
                    if size is None:
                        raise _Refused(f"alias *{clip(event.anchor, 60)} inside the node it names",
                                       event.start_mark)
                    self.kv_aliased = True
                    self.kv_count(size, event.start_mark)
                return super().compose_node(parent, index)
            if self.kv_depth >= MAX_DEPTH and not isinstance(event, ScalarEvent):
                raise _Refused(f"nested more than {MAX_DEPTH} levels deep", event.start_mark)
            before = self.kv_nodes
            self.kv_count(1, event.start_mark)
            self.kv_depth += 1
            try:
                node = super().compose_node(parent, index)
            finally:
                self.kv_depth -= 1
            if event.anchor is not None:
                self.kv_sizes[event.anchor] = self.kv_nodes - before
            return node

    class _Constructor(SafeConstructor):
        def kv_mapping(self, node: Any) -> dict[Any, Any]:
            if not isinstance(node, MappingNode):
                raise _Refused(f"expected a mapping, got a {node.id}", node.start_mark)
            # flatten_mapping puts the merged pairs first and keeps the explicit ones, in order,
            # after them: the explicit pairs are the last ones. (By node identity, a merged key
            # that an explicit alias of the same key node overrides was "a duplicate key".)
            explicit = sum(1 for k, _ in node.value if k.tag != _TAG + "merge")
            self.flatten_mapping(node)
            first_explicit = len(node.value) - explicit
            out: dict[Any, Any] = {}
            given: set[Any] = set()
            for index, (key_node, value_node) in enumerate(node.value):
                if not isinstance(key_node, ScalarNode):
                    kind = "list" if isinstance(key_node, SequenceNode) else "mapping"
                    raise _Refused(f"a {kind} as a mapping key (keys are strings or numbers)",
                                   key_node.start_mark)
                key = self.construct_object(key_node)
                try:
                    hash(key)
                except TypeError:
                    raise _Refused(f"a {type(key).__name__} as a mapping key", key_node.start_mark) from None
                if index >= first_explicit:
                    if key in given:
                        raise _Refused(f"duplicate key {brief(key)}", key_node.start_mark)
                    given.add(key)
                out[key] = self.construct_object(value_node)
            return out

        def kv_base60(self, node: Any) -> None:
            # YAML 1.1's base-60 numbers (1:30 is 90): PyYAML multiplies by 60 once per part, so
            # 10**6 parts cost minutes (quadratic), and a float's parts overflowed.
            if str(node.value).count(":") >= _MAX_BASE60_PARTS:
                raise _Refused(f"number {brief(node.value)} has more than {_MAX_BASE60_PARTS} ':' parts "
                               "(a YAML 1.1 base-60 number)", node.start_mark)

        def kv_int(self, node: Any) -> int:
            self.kv_base60(node)
            try:
                return SafeConstructor.construct_yaml_int(self, node)
            except (ValueError, LookupError):  # LookupError: "!!int ''"
                what = "integer with too many digits" if len(str(node.value)) > 1000 else \
                    f"invalid integer {brief(node.value)}"
                raise _Refused(what, node.start_mark) from None

        def kv_float(self, node: Any) -> float:
            self.kv_base60(node)
            try:
                return SafeConstructor.construct_yaml_float(self, node)
            except (ValueError, LookupError, OverflowError):
                raise _Refused(f"invalid number {brief(node.value)}", node.start_mark) from None

        def kv_bool(self, node: Any) -> bool:
            try:
                return SafeConstructor.construct_yaml_bool(self, node)
            except LookupError:  # "!!bool maybe"
                raise _Refused(f"invalid boolean {brief(node.value)}", node.start_mark) from None

        def kv_refuse(self, node: Any) -> Any:
            raise _Refused(f"YAML type !!{node.tag.rsplit(':', 1)[-1]} is not a configuration value",
                           node.start_mark)

    _Constructor.add_constructor(_TAG + "map", _Constructor.kv_mapping)
    _Constructor.add_constructor(_TAG + "int", _Constructor.kv_int)
    _Constructor.add_constructor(_TAG + "float", _Constructor.kv_float)
    _Constructor.add_constructor(_TAG + "bool", _Constructor.kv_bool)
    for name in _REFUSED_TAGS:
        _Constructor.add_constructor(_TAG + name, _Constructor.kv_refuse)

    try:
        from yaml._yaml import CParser  # libyaml: the scanner and parser in C, ~4x faster
    except ImportError:  # pragma: no cover - PyYAML without libyaml
        CParser = None

    if CParser is not None:
        class _Loader(_Composer, CParser, _Constructor, _Resolver):  # type: ignore[misc,valid-type]
            def __init__(self, stream: str) -> None:
                CParser.__init__(self, stream)
                _Composer.__init__(self)
                _Constructor.__init__(self)
                _Resolver.__init__(self)
    else:  # pragma: no cover
        from yaml.parser import Parser
        from yaml.reader import Reader
        from yaml.scanner import Scanner

        class _Loader(Reader, Scanner, Parser, _Composer, _Constructor, _Resolver):  # type: ignore[no-redef]
            def __init__(self, stream: str) -> None:
                Reader.__init__(self, stream)
                Scanner.__init__(self)
                Parser.__init__(self)
                _Composer.__init__(self)
                _Constructor.__init__(self)
                _Resolver.__init__(self)

    _LOADER = _Loader
    return _LOADER


def parse_yaml(text: str | bytes, source: str | None = None, *, max_nodes: int = MAX_NODES) -> Any:
    """Parses one YAML document under this module's rules; ``None`` for an empty one. A syntax
    error or a broken rule is a :class:`ConfigError` naming the line (``source``: the file).

    ``text`` is a ``str``, or bytes of UTF-8 as a file must be (PyYAML itself would also take
    UTF-16, and read a stream to its end, however long); anything else is an
    :class:`ArgumentTypeError`."""
    if isinstance(text, (bytes, bytearray)):
        text = _utf8_text(bytes(text), source)
    elif isinstance(text, str):
        text = str.__str__(text)  # a subclass was "invalid YAML: TypeError" from libyaml
    else:
        raise ArgumentTypeError(f"YAML text must be a str or bytes, got {type(text).__name__}")
    max_nodes = integer(max_nodes, "max_nodes", 0)
    yaml = yaml_module()
    loader = None
    try:
        loader = _loader_class()(text)  # PyYAML's own Reader checks the characters here
        loader.kv_max_nodes = max_nodes
        doc = loader.get_single_data()
    except _Refused as e:
        raise ConfigError(e.text(), None, source) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or (str(e).splitlines() or [type(e).__name__])[0]
        context = getattr(e, "context", None)
        if isinstance(context, str) and context.startswith("expected"):  # a second document
            problem = f"{context}, {problem}"
        problem = clip(problem)  # PyYAML quotes a tag or alias name whole: a line of 4 MB
        position = getattr(e, "position", None)  # a ReaderError: a character YAML does not allow
        if mark is None and isinstance(position, int):
            where = f" at offset {position}"
        raise ConfigError(f"invalid YAML: {problem}{where}", None, source) from None
    except RecursionError:  # not expected: MAX_DEPTH comes first
        raise ConfigError("nested too deeply", None, source) from None
    except (ValueError, LookupError, TypeError) as e:  # not expected: a constructor's own error
        raise ConfigError(f"invalid YAML: {type(e).__name__}: {brief(str(e), 80)}", None, source) from None
    finally:
        if loader is not None:
            loader.dispose()
    check_values(doc, source, max_nodes=max_nodes)
    return doc


def load_yaml(path: str | os.PathLike[str], *, max_nodes: int = MAX_NODES) -> Any:
    """Reads (:func:`read_config_text`) and parses (:func:`parse_yaml`) a YAML file."""
    max_nodes = integer(max_nodes, "max_nodes", 0)
    text = read_config_text(path)
    return parse_yaml(text, os.fsdecode(os.fspath(path)), max_nodes=max_nodes)


# --------------------------------------------------------------------------- JSON


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Refused(f"duplicate key {brief(key)}")
        out[key] = value
    return out


def _refuse_constant(name: str) -> Any:
    raise _Refused(f"{name} is not valid JSON (numbers must be finite)")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise _Refused(f"number {brief(text)} is out of range")
    return value


#: A JSON string (an unterminated one runs to the end); what is left between strings is structure.
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_BRACKET_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}
#: A ``\uD800``-``\uDFFF`` escape: may decode to a lone surrogate, which no UTF-8 text holds.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")


def _json_too_deep(text: str, max_depth: int) -> bool:
    """Whether ``text`` opens more than ``max_depth`` arrays/objects inside each other, found
    before parsing (json.loads recurses per level: a deep document would cost a RecursionError
    at best)."""
    if text.count("[") + text.count("{") <= max_depth:
        return False
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    return max(accumulate(map(_BRACKET_STEP.__getitem__, brackets.encode("ascii"))), default=0) > max_depth


def loads_strict_json(text: str | bytes, source: str | None = None, *, finite: bool = True) -> Any:
    """``json.loads`` under RFC 8259's rules: no duplicate keys, no ``NaN``/``Infinity`` and no
    number that overflows a float (unless ``finite`` is False: then :func:`check_values` refuses
    them later, naming the field), at most :data:`MAX_DEPTH` levels of nesting (checked before
    parsing, whatever the depth), Unicode text only (no lone surrogate, raw or escaped: it could
    not be written out as UTF-8). The one strict JSON parser (config files and command-line JSON
    here, HTTP request bodies in the indexer and the proxy); a :class:`ConfigError` otherwise."""
    if not isinstance(text, (str, bytes, bytearray)):  # .isascii() below was an AttributeError
        raise ArgumentTypeError(f"JSON text must be a str or bytes, got {type(text).__name__}")
    if isinstance(text, (bytes, bytearray)):
        # RFC 8259 8.1: JSON between systems is UTF-8 (a BOM may be ignored). json.loads would
        # also take UTF-16 and UTF-32, which no other JSON reader of ours accepts.
        encoding = json.detect_encoding(text)
        if encoding not in ("utf-8", "utf-8-sig"):
            raise ConfigError(f"invalid JSON: not UTF-8 (the bytes read as {encoding.upper()}; JSON text is UTF-8)",
                              None, source)
        try:
            text = bytes(text).decode(encoding)
        except UnicodeDecodeError:
            raise ConfigError("invalid JSON: not UTF-8", None, source) from None
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ConfigError(f"invalid JSON: a lone surrogate at offset {e.start} (not Unicode text)",
                              None, source) from None
    if _json_too_deep(text, MAX_DEPTH):
        raise ConfigError(f"nested more than {MAX_DEPTH} levels deep", None, source)
    hooks: dict[str, Any] = {"parse_constant": _refuse_constant, "parse_float": _finite_float} if finite else {}
    try:
        doc = json.loads(text, object_pairs_hook=_json_object, **hooks)
    except _Refused as e:
        raise ConfigError(e.text(), None, source) from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"invalid JSON: {e.msg} at line {e.lineno} column {e.colno}", None, source) from None
    except RecursionError:  # not expected: the depth is checked first
        raise ConfigError(f"nested more than {MAX_DEPTH} levels deep", None, source) from None
    except ValueError:  # an integer with more digits than Python converts
        raise ConfigError("invalid JSON: an integer with too many digits", None, source) from None
    if "\\u" in text and _SURROGATE_ESCAPE.search(text):
        try:  # a pair decodes to one character; only an unpaired escape fails here
            json.dumps(doc, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ConfigError("invalid JSON: a \\u escape of a lone surrogate (not Unicode text)",
                              None, source) from None
    return doc


def parse_json(text: str, source: str | None = None, *, max_nodes: int = MAX_NODES) -> Any:
    """Parses JSON under this module's rules (:func:`loads_strict_json`, then bounded nesting and
    size); a :class:`ConfigError` naming the line or the field otherwise."""
    max_nodes = integer(max_nodes, "max_nodes", 0)  # before parsing: a str was a TypeError after it
    doc = loads_strict_json(text, source, finite=False)
    check_values(doc, source, max_nodes=max_nodes)
    return doc


def load_json(path: str | os.PathLike[str]) -> Any:
    """Reads (:func:`read_config_text`) and parses (:func:`parse_json`) a JSON file."""
    text = read_config_text(path)
    return parse_json(text, os.fsdecode(os.fspath(path)))


def dump_json(value: Any, *, indent: int | None = None, **kw: Any) -> str:
    """``json.dumps`` that never writes a bare ``NaN``/``Infinity`` (nor ``str()`` of an unknown
    type): such a value is a :class:`ConfigError`."""
    try:
        return json.dumps(value, indent=indent, allow_nan=False, **kw)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"cannot be written as JSON: {e}") from None
    except RecursionError:  # nested deeper than the interpreter's stack (100,000 lists)
        raise ConfigError("cannot be written as JSON: nested too deep") from None
    except Exception as e:  # a dict subclass whose own items() raises: it was let through
        raise ConfigError(f"cannot be written as JSON: reading it raised {type(e).__name__}") from None


__all__ = [
    "INT_MAX",
    "INT_MIN",
    "MAX_BYTES",
    "MAX_DEPTH",
    "MAX_KEY_CHARS",
    "MAX_ENGINE_NODES",
    "MAX_NODES",
    "MAX_TEXT_CHARS",
    "check_values",
    "dump_json",
    "expand_home",
    "load_json",
    "load_yaml",
    "parse_json",
    "parse_yaml",
    "read_config_text",
    "text_problem",
    "yaml_module",
]
