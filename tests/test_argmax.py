"""The decode graphs' argmax kernel (kernels/argmax.py) against torch.argmax: ties, NaN, -inf rows, partial chunks,
strided outputs. On CUDA, or in the Triton interpreter on the CPU."""

from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, DTYPES, skip_module_without_kernels
from orinfer.kernels.argmax import argmax_rows, argmax_rows_ref

skip_module_without_kernels()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,vocab,chunk", [(1, 1000, 256), (3, 211, 64), (2, 4096, 4096), (4, 5000, 1024)])
def test_argmax_rows_matches_torch(dtype, batch, vocab, chunk):
    torch.manual_seed(0)
    logits = torch.randn(batch, vocab, device=DEVICE).to(dtype)
    assert torch.equal(argmax_rows(logits, chunk=chunk), argmax_rows_ref(logits))


def test_argmax_rows_takes_the_first_of_tied_values_across_chunks():
    logits = torch.zeros(3, 700, device=DEVICE)
    logits[0, [650, 5, 300]] = 2.0           # the first is in chunk 0
    logits[1, [699, 130]] = 3.0              # a later chunk holds the first
    logits[2] = float("-inf")                # nothing above -inf: index 0, as torch
    got = argmax_rows(logits, chunk=128)
    assert got.tolist() == [5, 130, 0] == argmax_rows_ref(logits).tolist()


def test_argmax_rows_counts_nan_as_largest_like_torch():
    logits = torch.randn(3, 600, device=DEVICE)
    logits[0, 400] = float("nan")
    logits[0, 10] = float("inf")              # +inf in an earlier chunk: the NaN still wins
    logits[1, [550, 520]] = float("nan")      # the first NaN of the row
    logits[2, 3] = 1e30
    got = argmax_rows(logits, chunk=128)
    assert got.tolist() == argmax_rows_ref(logits).tolist() == [400, 520, 3]


def test_argmax_rows_writes_into_a_strided_out():
    logits = torch.randn(4, 300, device=DEVICE)
    rows = torch.full((3, 4), -1, dtype=torch.int64, device=DEVICE)
    argmax_rows(logits, out=rows[1], chunk=64)
    assert torch.equal(rows[1], argmax_rows_ref(logits))
    assert (rows[0] == -1).all() and (rows[2] == -1).all()
    column = torch.full((4, 2), -1, dtype=torch.int64, device=DEVICE)
    argmax_rows(logits, out=column[:, 1], chunk=64)
    assert torch.equal(column[:, 1], argmax_rows_ref(logits)) and (column[:, 0] == -1).all()


def test_argmax_rows_rejects_bad_shapes():
    with pytest.raises(ValueError, match="unit last stride"):
        argmax_rows(torch.randn(4, 10, device=DEVICE).t())
    with pytest.raises(ValueError, match="int64"):
        argmax_rows(torch.randn(2, 10, device=DEVICE), out=torch.empty(2, dtype=torch.int32, device=DEVICE))


def test_argmax_rows_also_writes_the_mirror_row_the_device_index_names():
    logits = torch.randn(3, 500, device=DEVICE)
    mirror = torch.full((2, 5), -1, dtype=torch.int64, device=DEVICE)
    row = torch.tensor([1], dtype=torch.int64, device=DEVICE)
    ids = argmax_rows(logits, chunk=128, mirror=mirror, mirror_row=row)
    assert torch.equal(ids, argmax_rows_ref(logits)) and torch.equal(mirror[1, :3], ids)
    assert (mirror[0] == -1).all() and (mirror[1, 3:] == -1).all()
    row.fill_(0)   # the row is read when the kernel runs
    argmax_rows(logits, chunk=128, mirror=mirror, mirror_row=row)
    assert torch.equal(mirror[0, :3], ids)


def test_argmax_rows_rejects_a_bad_mirror():
    logits = torch.randn(3, 50, device=DEVICE)
    row = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="go together"):
        argmax_rows(logits, mirror=torch.zeros(2, 3, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="mirror must be"):
        argmax_rows(logits, mirror=torch.zeros(2, 2, dtype=torch.int64, device=DEVICE), mirror_row=row)
    with pytest.raises(ValueError, match="mirror must be"):
        argmax_rows(logits, mirror=torch.zeros(2, 3, dtype=torch.int32, device=DEVICE), mirror_row=row)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_argmax_rows_writes_a_pinned_host_mirror_from_the_device():
    """The decode graphs' use: the kernel stores into pinned host memory; after a sync the host reads the ids."""
    logits = torch.randn(2, 151936, device="cuda", dtype=torch.bfloat16)
    mirror = torch.full((2, 4), -1, dtype=torch.int64, pin_memory=True)
    row = torch.tensor([1], dtype=torch.int64, device="cuda")
    ids = argmax_rows(logits, mirror=mirror, mirror_row=row)
    torch.cuda.synchronize()
    assert mirror[1, :2].tolist() == ids.tolist() == argmax_rows_ref(logits).tolist()
    assert mirror[0].tolist() == [-1] * 4
