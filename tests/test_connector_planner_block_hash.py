"""ConnectorPlanner reads an int block hash with the bindings' one integer conversion, its low 64
bits as vLLM masks one: a numpy bool is refused as a bool is (ArgumentTypeError; it was an
InvalidArgumentError), and no method but ``__index__`` runs on an object that is neither bytes
nor int (``__and__`` was called on it)."""

from __future__ import annotations

import numpy as np
import pytest

from kvslots import ArgumentTypeError

from test_connector_planner_bools import _cached, _running, _snapshot


class Anded:
    """Neither bytes nor int; its __and__ answers an int (it was called and taken)."""

    calls = 0

    def __and__(self, other):
        type(self).calls += 1
        return 5


@pytest.mark.parametrize("bad", [True, np.True_, np.bool_(False), Anded(), 1.0, "5", None])
def test_a_block_hash_that_is_no_int_is_a_type_error(bad):
    Anded.calls = 0
    p, r = _running()
    before = _snapshot(p, [r.request_id])
    r.block_hashes[0] = bad
    with pytest.raises(ArgumentTypeError, match="block hash"):
        p.build(_cached(r, [([9001],)], [r.num_computed_tokens]))
    assert _snapshot(p, [r.request_id]) == before
    assert Anded.calls == 0


def _hashes(h):
    """The hashes a request's stored blocks are registered under, its first hash `h`."""
    p, r = _running()
    r.block_hashes[0] = h
    p.build(_cached(r, [([9001],)], [r.num_computed_tokens]))
    p.complete(p.step, 1, None, 0)
    return sorted(p.registered_hashes())


@pytest.mark.parametrize("h, same_as", [(2**70 + 5, 5), (-1, 2**64 - 1), (-2**100 + 3, 3),
                                        (np.uint64(2**64 - 2), 2**64 - 2), (np.int64(-2), 2**64 - 2)])
def test_an_int_block_hash_is_its_low_64_bits(h, same_as):
    assert same_as in _hashes(h)
    assert _hashes(h) == _hashes(same_as) != _hashes(same_as ^ 1)
