"""``BlockLayout.from_tensors`` given tensors whose memory is not their values at
``data_ptr()``, or a duck-typed tensor with a bad address or a huge shape: a kvslots error
before any segment is made (a sparse tensor was a RuntimeError, a nested one an AttributeError,
a meta one a layout of the bytes at address 0, and a meta tensor of shape [2**40, N, 4] looped
over 2**40 segments)."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

from kvslots.errors import ArgumentTypeError, InvalidArgumentError
from kvslots.vllm.pd.layout import MAX_SEGMENTS, BlockLayout

N = 8


@pytest.mark.parametrize("make, word", [
    (lambda: torch.zeros(N, 4).to_sparse(), "layout"),
    (lambda: torch.nested.nested_tensor([torch.zeros(N, 4)], layout=torch.jagged), "nested"),
    (lambda: torch.zeros(N, 4, device="meta"), "meta"),
    (lambda: [torch.zeros(N, 4), torch.zeros(N, 4, device="meta")], "meta"),
])
def test_tensors_without_memory_at_their_address_are_refused(make, word):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = make()
    with pytest.raises(InvalidArgumentError, match=word):
        BlockLayout.from_tensors({"a": t}, N)


def test_a_meta_tensor_with_2_to_the_40_segments_is_refused_at_once():
    # In a child with a time limit: the old code loops (and allocates) without end.
    code = ("import torch\nfrom kvslots.vllm.pd.layout import BlockLayout\n"
            "from kvslots.errors import InvalidArgumentError\n"
            "try:\n    BlockLayout.from_tensors({'a': torch.zeros(2**40, 8, 4, device='meta')}, 8)\n"
            "except InvalidArgumentError as e:\n    print('refused:', e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "refused" in r.stdout, (r.returncode, r.stderr[-1000:])


class Fake:
    """What from_tensors reads of a tensor (it takes any object with ``data_ptr``)."""

    def __init__(self, shape=(N, 4), addr=2**20):
        self.shape, self.addr = shape, addr

    def data_ptr(self):
        return self.addr

    def is_contiguous(self):
        return True

    def element_size(self):
        return 4


def test_a_duck_typed_tensor_with_a_bad_address_or_shape_is_refused():
    assert BlockLayout.from_tensors({"a": Fake()}, N).bytes_per_block == 16
    with pytest.raises(InvalidArgumentError, match="data_ptr"):
        BlockLayout.from_tensors({"a": Fake(addr=-5)}, N)
    with pytest.raises(ArgumentTypeError, match="data_ptr"):
        BlockLayout.from_tensors({"a": Fake(addr="x")}, N)
    with pytest.raises(InvalidArgumentError, match="segments"):
        BlockLayout.from_tensors({"a": Fake(shape=(MAX_SEGMENTS + 1, N, 4))}, N)
    # A real tensor just under the bound is still described, one segment per outer index.
    layout = BlockLayout.from_tensors({"a": torch.zeros(3, N, 4)}, N)
    assert len(layout.segments) == 3 and layout.bytes_per_block == 3 * 16
