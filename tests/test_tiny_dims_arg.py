"""kvslots._dev.tiny.build_tiny_models checks its dims argument."""

import pytest

from kvslots.errors import ConfigError
from kvslots._dev.tiny import build_tiny_models


@pytest.mark.parametrize("dims", [5, {"layers": 2}, None, (2, 128, 4, 2, 256)])
def test_dims_that_is_no_dims_is_a_config_error(dims, tmp_path):
    """dims=5 or a dict raised dataclasses.asdict's builtin TypeError; now a ConfigError naming
    dims, before anything is written."""
    with pytest.raises(ConfigError, match="dims.*must be a Dims"):
        build_tiny_models(str(tmp_path / "m"), dims=dims)
    assert not (tmp_path / "m").exists()
