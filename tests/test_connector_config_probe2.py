"""kv_connector_extra_config probed with sizes: an error stays a message of bounded length
however many keys are wrong."""

from __future__ import annotations

import pytest

from kvslots.config.connector import ConnectorConfig
from kvslots.errors import ConnectorConfigError


@pytest.mark.parametrize("extra", [
    {f"k{i}": 1 for i in range(100_000)},           # the message was 1 MB
    {f"k{i}" * 50: 1 for i in range(1000)},          # 62 KB
    {**{i: 1 for i in range(50)}, "host_cache_gb": 1.0},
])
def test_many_unknown_keys_make_a_bounded_message_naming_some(extra):
    with pytest.raises(ConnectorConfigError, match=r"unknown key\(s\) .* more; known keys: copy_threads") as ei:
        ConnectorConfig.from_extra_config(extra)
    assert len(str(ei.value)) < 2000
    unknown = len([k for k in extra if k != "host_cache_gb"])
    assert f"and {unknown - 10} more" in str(ei.value)


def test_a_few_unknown_keys_are_all_named():
    with pytest.raises(ConnectorConfigError) as ei:
        ConnectorConfig.from_extra_config({"b": 1, "a": 2, 3: 4, "copy_threads": 2})
    assert "unknown key(s) 'a', 'b', 3; known keys:" in str(ei.value)
