"""kvslots._dev.simulate.run checks the SimConfig it is given as it is when run."""

import threading

import pytest

from kvslots.errors import ArgumentTypeError, InvalidArgumentError
from kvslots._dev.simulate import SimConfig, run


def _small():
    return SimConfig(requests=4, batch=2, prompt_min=4, prompt_max=8, shared_prefix=0, output_min=2,
                     output_max=4, num_blocks=64, block_size=4)


@pytest.mark.parametrize("field, value, kind", [("batch", 0, InvalidArgumentError),
                                                ("acceptance", float("nan"), InvalidArgumentError),
                                                ("prompt_max", 2, InvalidArgumentError),
                                                ("requests", "4", ArgumentTypeError)])
def test_a_field_set_after_the_config_was_made_is_checked(field, value, kind):
    """SimConfig checks its fields when made, but it is a mutable dataclass: cfg.batch = 0 set
    afterwards made run() admit no request and loop for ever (a NaN acceptance, a prompt_max
    below prompt_min, a str count ran on too). Now run() checks them first: a kvslots error,
    at once."""
    cfg = _small()
    setattr(cfg, field, value)
    out = []

    def go():
        try:
            run(cfg)
            out.append("ran")
        except Exception as e:  # noqa: BLE001 - the test checks which
            out.append(e)

    t = threading.Thread(target=go, daemon=True)  # the old code never returned
    t.start()
    t.join(10)
    assert not t.is_alive() and len(out) == 1 and isinstance(out[0], kind), out


def test_a_good_config_still_runs():
    rep = run(_small())
    assert rep.completed == 4
