"""BlockCopier given layer tensors that are not plain strided memory, and id lists far longer
than any copy can be: a kvslots error before anything is allocated or copied (a quantized
layer crashed the process; sparse, nested, conjugate, negative and meta tensors were torch
errors; a broadcast id array of 2**26 ids took 3 GB before it was refused)."""

from __future__ import annotations

import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
import torch

from kvslots.errors import ArgumentTypeError, InvalidArgumentError, KVSlotsError
from kvslots.vllm.transfer import BlockCopier

N = 8


def _quantized() -> torch.Tensor:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates quantized tensors
        return torch.quantize_per_tensor(torch.zeros(N, 4), 0.1, 0, torch.qint8)


def test_a_quantized_layer_is_refused_instead_of_crashing_the_process():
    # Run in a child: on the old code the byte view of a quantized tensor is a segfault.
    code = ("import sys, warnings; warnings.simplefilter('ignore'); import torch\n"
            "from kvslots.vllm.transfer import BlockCopier\n"
            "from kvslots.errors import InvalidArgumentError\n"
            "q = torch.quantize_per_tensor(torch.zeros(8, 4), 0.1, 0, torch.qint8)\n"
            "try:\n    BlockCopier({'a': q}, 8, 4)\nexcept InvalidArgumentError as e:\n"
            "    print('refused:', e); sys.exit(0)\nsys.exit(3)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "quantized" in r.stdout


@pytest.mark.parametrize("make, word", [
    (lambda: torch.zeros(N, 4).to_sparse(), "layout"),
    (lambda: torch.zeros(N, 4).to_sparse_csr(), "layout"),
    (lambda: torch.zeros(N, 4, dtype=torch.complex64).conj(), "conjugate"),
    (lambda: torch._neg_view(torch.zeros(N, 4)), "negative"),
    (lambda: torch.nested.nested_tensor([torch.zeros(N, 4)], layout=torch.jagged), "nested"),
    (lambda: torch.zeros(N, 4, device="meta"), "meta"),
])
@pytest.mark.parametrize("engine", ["auto", "torch"])
def test_layers_without_plain_bytes_are_invalid_arguments(make, word, engine):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sparse CSR / nested: "beta" and "prototype" warnings
        t = make()
    with pytest.raises(InvalidArgumentError, match=word):
        BlockCopier({"a": t}, N, 4, engine=engine)


def test_plain_layers_of_unusual_dtypes_still_copy():
    for dtype in (torch.complex64, torch.bool, torch.float8_e4m3fn, torch.uint64):
        raw = torch.randint(0, 2, (N, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
        t = raw.view(dtype)  # bytes of 0 and 1: valid values of every one of them
        c = BlockCopier({"a": t}, N, 4)
        c.store([3, 5], [0, 1])
        c.load([0, 1], [6, 7])
        assert torch.equal(raw[6], raw[3]) and torch.equal(raw[7], raw[5])


@pytest.mark.parametrize("engine", ["rust", "torch"])
@pytest.mark.parametrize("kind", ["numpy", "tensor"])
def test_an_id_list_longer_than_the_destination_is_refused_before_it_is_scanned(engine, kind):
    c = BlockCopier({"a": torch.arange(N * 4, dtype=torch.float32).view(N, 4)}, N, 4, engine=engine)
    before = (c.host.clone(), c.host_block_view(0)["a"].clone())
    n = 2**22
    if kind == "numpy":
        ids = np.broadcast_to(np.int64(0), (n,))  # a view: 8 bytes, 4 Mi ids
    else:
        ids = torch.zeros(1, dtype=torch.int64).expand(n)
    tracemalloc.start()
    try:
        with pytest.raises(InvalidArgumentError, match="ids"):
            c.store(ids, ids)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # The old code made masks, an int64 copy and a set of all 4 Mi ids (~400 MB) to find the
    # repeated destination; now the length is enough.
    assert peak < 4 * 2**20, f"{peak} bytes traced"
    assert torch.equal(c.host, before[0])
    # The longest copy there can be still works: every destination block once.
    c.load(np.zeros(N, dtype=np.int64) + 1, np.arange(N))
    with pytest.raises(InvalidArgumentError, match="ids"):
        c.load(np.zeros(N + 1, dtype=np.int64), np.arange(N + 1) % N)


def test_bad_ids_are_still_kvslots_errors():
    c = BlockCopier({"a": torch.zeros(N, 4)}, N, 4)
    for dev, host in ([[-1], [0]], [[0.5], [0]], [[0, 1], [0, 0]], ["01", [0]], [[[0]], [[0]]], [[2**70], [0]]):
        with pytest.raises(KVSlotsError):
            c.store(dev, host)
    with pytest.raises(ArgumentTypeError):
        c.store(torch.zeros(2, dtype=torch.float32), [0, 1])


def test_an_endless_iterator_of_layer_tensors_is_refused():
    # Its tensors were collected without end (1.6 GB in 8 s).
    import itertools

    from kvslots.vllm import transfer

    MAX_LAYER_TENSORS = getattr(transfer, "MAX_LAYER_TENSORS", 1 << 16)

    t = torch.zeros(N, 4)

    def endless():  # stands in for an endless one, without eating the machine's memory on failure
        yield from itertools.repeat(t, 4 * MAX_LAYER_TENSORS)
        raise AssertionError("read 4 times the bound of tensors")

    with pytest.raises(InvalidArgumentError, match="more than"):
        BlockCopier({"a": endless()}, N, 4)
    with pytest.raises(InvalidArgumentError, match="more than"):
        BlockCopier({f"l{i}": t for i in range(MAX_LAYER_TENSORS + 1)}, N, 4)
    # A list of tensors, and one tensor shared by many names, are as before.
    c = BlockCopier({"a": [torch.zeros(N, 4), torch.zeros(N, 2)], "b": t, "c": t}, N, 4)
    assert c.bytes_per_block == 16 + 8 + 16


def test_copies_from_several_threads_each_move_their_own_blocks():
    # The gather / scatter path (CUDA's, here on CPU tensors) shares its staging buffers: two
    # threads' chunks interleaved in them, and a store got another's bytes (8 of 1,200 here).
    import threading

    n = 64
    t = torch.arange(n * 1024, dtype=torch.float32).view(n, 1024)
    c = BlockCopier({"a": t}, n, n, engine="torch", staging_bytes=1 << 16)
    wrong: list[int] = []

    def work(k: int) -> None:
        rng = np.random.default_rng(k)
        host = np.arange(16) + 16 * k  # each thread its own host blocks
        for _ in range(300):
            dev = rng.permutation(n)[:16]
            c.store(dev, host).wait()
            if not torch.equal(c.host[host].view(torch.float32), t[dev]):
                wrong.append(k)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert wrong == []
