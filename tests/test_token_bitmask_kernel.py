"""The structured-output mask kernel (kernels/token_bitmask.py) against its torch reference: odd vocabularies, masks
narrower than the logits, bit 31 (negative words), unconstrained rows left bit for bit. On CUDA, or in the Triton
interpreter on the CPU."""

from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, DTYPES, skip_module_without_kernels
from orinfer.kernels.token_bitmask import apply_token_bitmask_, apply_token_bitmask_ref, unpack_bitmask

skip_module_without_kernels()


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """[C, V] bool -> [C, ceil(V/32)] int32 words (bit v % 32 of word v // 32), as llguidance fills them."""
    c, v = allowed.shape
    padded = torch.nn.functional.pad(allowed, (0, -v % 32)).reshape(c, -1, 32).to(torch.int64)
    words = (padded << torch.arange(32)).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,vocab,rows,extra,block", [(5, 70, [3, 0, 4], 0, 64), (4, 1000, [1], 40, 256),
                                                          (3, 4096, [0, 1, 2], 0, 1024), (6, 5000, [5, 2], 100, 4096)])
def test_kernel_matches_reference(dtype, batch, vocab, rows, extra, block):
    """`extra`: logits wider than the mask's ids (a model vocabulary beyond the tokenizer's): those are refused."""
    gen = torch.Generator().manual_seed(vocab)
    allowed = torch.rand(len(rows), vocab, generator=gen) < 0.3
    allowed[:, 31::32] = True  # bit 31 set: negative words
    bitmask = _pack(allowed).to(DEVICE)
    logits = torch.randn(batch, vocab + extra, generator=gen).to(dtype).to(DEVICE)
    index = torch.tensor(rows, device=DEVICE)
    want = apply_token_bitmask_ref(logits, index, bitmask)
    got = apply_token_bitmask_(logits.clone(), index, bitmask, block=block)
    assert torch.equal(got, want)
    free = [r for r in range(batch) if r not in rows]
    assert torch.equal(got[free], logits[free])  # unconstrained rows bit for bit
    refused = ~unpack_bitmask(bitmask, vocab + extra).cpu()
    assert torch.isinf(got[index].cpu()[refused]).all() and not torch.isinf(got[index].cpu()[~refused]).any()


def test_no_constrained_row_and_bad_shapes():
    logits = torch.randn(2, 64, device=DEVICE)
    empty = torch.zeros(0, 2, dtype=torch.int32, device=DEVICE)
    assert torch.equal(apply_token_bitmask_(logits.clone(), torch.zeros(0, dtype=torch.int64, device=DEVICE), empty),
                       logits)
    with pytest.raises(ValueError, match="bitmask must be"):
        apply_token_bitmask_(logits, torch.tensor([0], device=DEVICE), torch.zeros(1, 2, device=DEVICE))
    with pytest.raises(ValueError, match="rows must be"):
        apply_token_bitmask_(logits, torch.tensor([0, 1], device=DEVICE),
                             torch.zeros(1, 2, dtype=torch.int32, device=DEVICE))
