"""Checks of the arguments of kvslots' pure-Python entry points (events, block copies), in one
place: what an int, a number, a flag, a text or a callback argument accepts. A wrong type raises
:class:`ArgumentTypeError`, a value out of range :class:`InvalidArgumentError`, both naming the
argument. (The slot API's own checks live in the Rust core and its reference model.)"""

from __future__ import annotations

import ipaddress
import math
import numbers
import operator
import re
from collections.abc import Callable
from typing import Any, Literal, overload

from .errors import ArgumentTypeError, InvalidArgumentError, KVSlotsError, short_repr

#: The largest C ``int``: ZMQ socket options (high-water marks, linger) are ints.
C_INT_MAX = 2**31 - 1


def integer(value: Any, name: str, lo: int | None = None, hi: int | None = None) -> int:
    """``value`` as an int in ``[lo, hi]`` (either end open when None). Anything with
    ``__index__`` but a bool is an int; floats and strings are not."""
    if isinstance(value, bool):
        raise ArgumentTypeError(f"{name} must be an int, got bool {value!r}")
    try:
        v = operator.index(value)
    except KVSlotsError:
        raise
    except Exception:  # TypeError, or whatever a hostile __index__ raises
        raise ArgumentTypeError(f"{name} must be an int, got {type(value).__name__} {short_repr(value)}") from None
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise InvalidArgumentError(f"{name} must be in {span(lo, hi)}, got {_int_text(v)}")
    return v


def span(lo: int | None, hi: int | None) -> str:
    """``[lo, hi]`` as :func:`integer`'s errors state it (``[1, 2**24]``): for a --help that
    states the same bounds."""
    return f"[{_bound(lo)}, {_bound(hi)}]"


def number(value: Any, name: str, lo: float | None = None, hi: float | None = None, *,
           positive: bool = False, finite: bool = True) -> float:
    """``value`` (an int or float, not a bool, not NaN) as a float in ``[lo, hi]``, ``> 0`` with
    ``positive``; infinity only without ``finite``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy's count too
        raise ArgumentTypeError(f"{name} must be a number, got {type(value).__name__} {short_repr(value)}")
    try:
        v = float(value)
    except Exception:  # an int past float's range, or a hostile __float__
        raise InvalidArgumentError(f"{name} must be a number in range, got {short_repr(value)}") from None
    if math.isnan(v) or (finite and math.isinf(v)):
        raise InvalidArgumentError(f"{name} must be a {'finite ' if finite else ''}number, got {v}")
    if positive and not v > 0:
        raise InvalidArgumentError(f"{name} must be > 0, got {short_repr(value)}")
    if lo is not None and v < lo:
        raise InvalidArgumentError(f"{name} must be >= {lo:g}, got {short_repr(value)}")
    if hi is not None and v > hi:
        raise InvalidArgumentError(f"{name} must be <= {hi:g}, got {short_repr(value)}")
    return v


def timeout(value: Any, name: str = "timeout") -> float | None:
    """Seconds to wait: None (or infinity) waits without end, a negative value not at all."""
    if value is None:
        return None
    v = number(value, name, finite=False)
    return None if math.isinf(v) and v > 0 else max(v, 0.0)


# Typed per call: a required flag is a bool, only an optional one may be None.
@overload
def flag(value: Any, name: str, *, optional: Literal[False] = ...) -> bool: ...
@overload
def flag(value: Any, name: str, *, optional: bool) -> bool | None: ...
def flag(value: Any, name: str, *, optional: bool = False) -> bool | None:
    if value is None and optional:
        return None
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"{name} must be a bool, got {type(value).__name__} {short_repr(value)}")
    return value


def text(value: Any, name: str) -> str:
    """A ``str`` that encodes as UTF-8 (no lone surrogates: ZMQ and msgpack need the bytes),
    returned as an exact ``str``: a subclass's own ``encode`` / ``startswith`` could lie to the
    checks and to ZMQ."""
    if not isinstance(value, str):
        raise ArgumentTypeError(f"{name} must be a str, got {type(value).__name__} {short_repr(value)}")
    value = str.__str__(value)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgumentError(f"{name} must be valid Unicode text (no lone surrogates), got {short_repr(value)}") from None
    return value


#: A DNS label, as resolvers take it: letters, digits, '-' inside; '_' too (container and service
#: names use it, and getaddrinfo resolves them).
_HOST_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?\Z")


def host(value: Any, name: str) -> str:
    """An address peers can reach this machine at: a host name (``localhost``, ``node-1.lan``) or
    an IPv4 address, without a scheme or a port. A wildcard (``*``, ``0.0.0.0``) is no such
    address, and an IPv6 address is refused: Mooncake's TCP transport names a worker
    ``host:port`` and splits at the first ':'."""
    value = text(value, name)
    if not value or len(value) > 253:
        raise InvalidArgumentError(f"{name} must be a host name or IPv4 address (1 to 253 characters), got {short_repr(value)}")
    inner = value[1:-1] if value.startswith("[") and value.endswith("]") else value  # [::1], as in a URL
    try:
        address = ipaddress.ip_address(inner)
    except ValueError:
        address = None
    if value == "*" or (address is not None and address.is_unspecified):
        raise InvalidArgumentError(f"{name} {short_repr(value)} is a wildcard, not an address peers can reach: "
                                   "give this machine's host name or IPv4 address")
    if isinstance(address, ipaddress.IPv6Address):
        raise InvalidArgumentError(f"{name} {short_repr(value)} is an IPv6 address; Mooncake's TCP transport "
                                   "takes host names and IPv4 addresses only")
    if address is not None and inner == value:
        return value
    if not all(_HOST_LABEL.match(label) for label in value.removesuffix(".").split(".")):
        raise InvalidArgumentError(f"{name} must be a host name or IPv4 address, without a scheme, port "
                                   f"or spaces, got {short_repr(value)}")
    return value


def callback(value: Any, name: str, *, optional: bool = False) -> Callable[..., Any] | None:
    if value is None and optional:
        return None
    if not callable(value):
        raise ArgumentTypeError(f"{name} must be callable, got {type(value).__name__}")
    return value


def hashable(value: Any, name: str) -> Any:
    """A dict key: ``hash`` must work (a list, or an object whose ``__hash__`` raises, is not)."""
    try:
        hash(value)
    except Exception:
        raise ArgumentTypeError(f"{name} must be hashable, got {type(value).__name__}") from None
    return value


def _bound(b: int | None) -> str:
    if b is None:
        return "..."
    if b >= 2**20 and b & (b - 1) == 0:
        return f"2**{b.bit_length() - 1}"
    if b >= 2**20 and (b + 1) & b == 0:
        return f"2**{b.bit_length()}-1"
    return str(b)


def _int_text(v: int) -> str:
    """``v`` in a message: its digits up to 128 bits, else its size (an int of over 4,300 digits
    has no str: Python's ValueError came out of the message, and 10**10**6 took seconds)."""
    if v.bit_length() <= 128:
        return str(v)
    return f"{'a negative' if v < 0 else 'an'} int of {v.bit_length()} bits"

