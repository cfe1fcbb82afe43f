"""ConnectorConfig (kv_connector_extra_config) given exotic objects: a Mapping that raises when
read, str / int / float subclasses whose overrides raise. Every call succeeds, reading the exact
value, or raises a ConnectorConfigError; an override of the subclass never runs."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from kvslots.config.connector import ConnectorConfig
from kvslots.errors import ConnectorConfigError


class _Raises(Exception):
    pass


class _MappingRaises(Mapping):
    """A Mapping whose ``where`` method raises."""

    def __init__(self, where: str):
        self.where = where

    def __getitem__(self, key):
        if self.where == "getitem":
            raise _Raises("getitem")
        return 2

    def __iter__(self):
        if self.where == "iter":
            raise _Raises("iter")
        return iter(["copy_threads"])

    def __len__(self):
        if self.where == "len":
            raise _Raises("len")
        return 1

    def keys(self):
        if self.where == "keys":
            raise _Raises("keys")
        return super().keys()


class _IntLies(int):
    def __index__(self):
        raise _Raises("__index__")

    def __int__(self):
        raise _Raises("__int__")

    __lt__ = __le__ = __gt__ = __ge__ = __eq__ = __ne__ = lambda self, other: (_ for _ in ()).throw(_Raises("cmp"))
    __hash__ = int.__hash__


class _FloatLies(float):
    def __float__(self):
        raise _Raises("__float__")

    __lt__ = __le__ = __gt__ = __ge__ = __eq__ = __ne__ = lambda self, other: (_ for _ in ()).throw(_Raises("cmp"))
    __hash__ = float.__hash__


class _StrLies(str):
    def strip(self, *a):
        raise _Raises("strip")

    def lower(self):
        raise _Raises("lower")

    def encode(self, *a, **k):
        raise _Raises("encode")

    def __contains__(self, x):
        raise _Raises("__contains__")

    def __eq__(self, other):
        raise _Raises("__eq__")

    __hash__ = str.__hash__


@pytest.mark.parametrize("where", ["getitem", "iter", "keys"])
def test_a_mapping_that_raises_when_read_is_a_config_error(where):
    with pytest.raises(ConnectorConfigError, match="cannot be read as a mapping.*_Raises"):
        ConnectorConfig.from_extra_config(_MappingRaises(where))
    ConnectorConfig.from_extra_config(_MappingRaises("len"))  # read without its __len__ / __bool__


@pytest.mark.parametrize("key, value, expect", [
    ("copy_threads", _IntLies(3), 3), ("host_cache_blocks", _IntLies(7), 7), ("pd_port", _IntLies(80), 80),
    ("disk_queue_len", _IntLies(4), 4), ("host_cache_gb", _FloatLies(2.5), 2.5), ("disk_gb", _FloatLies(1.0), 1.0),
    ("pd_timeout_s", _FloatLies(5.0), 5.0), ("host_cache_gb", _IntLies(2), 2.0), ("disk_path", _StrLies("/tmp/d"), "/tmp/d"),
    ("events_topic", _StrLies("t"), "t"), ("pd_host", _StrLies("h"), "h"), ("eagle_block_drop", _StrLies("TRUE"), True),
    ("eagle_block_drop", _StrLies("auto"), "auto"),
], ids=lambda v: v if type(v) is str else type(v).__name__)
def test_number_and_text_subclasses_are_read_as_their_exact_value(key, value, expect):
    # Their comparisons, __float__, strip and the like raised through from_extra_config.
    cfg = ConnectorConfig.from_extra_config({key: value})
    got = getattr(cfg, key)
    assert got == expect and type(got) is type(expect)
    assert getattr(ConnectorConfig(**{key: value}), key) == expect


@pytest.mark.parametrize("key, value", [("copy_threads", _IntLies(0)), ("host_cache_gb", _FloatLies(float("nan"))),
                                        ("pd_timeout_s", _FloatLies(-1.0)), ("pd_port", _IntLies(1 << 40)),
                                        ("disk_path", _StrLies(" ")), ("events_topic", _StrLies("a\0b"))],
                         ids=lambda v: v if type(v) is str else type(v).__name__)
def test_number_and_text_subclasses_out_of_range_name_the_key(key, value):
    with pytest.raises(ConnectorConfigError, match=key):
        ConnectorConfig.from_extra_config({key: value})


def test_str_subclass_keys_are_read_as_their_text():
    class Key(str):
        def __hash__(self):
            return id(self)

        def __eq__(self, other):
            raise _Raises("__eq__")

    assert ConnectorConfig.from_extra_config({Key("copy_threads"): 2}).copy_threads == 2
    with pytest.raises(ConnectorConfigError, match="copy_threads given twice"):
        ConnectorConfig.from_extra_config({Key("copy_threads"): 2, Key("copy_threads"): 3})
    with pytest.raises(ConnectorConfigError, match="unknown key"):
        ConnectorConfig.from_extra_config({Key("nope"): 2})
