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
