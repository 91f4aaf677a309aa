"""The decode graphs' input advance (kernels/decode_inputs.py) against its torch reference: live and padding rows,
a block boundary, a block index past the table, and the host-ids row flip. On CUDA, or in the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, skip_module_without_kernels
from orinfer.kernels.decode_inputs import advance_decode_inputs, advance_decode_inputs_ref

skip_module_without_kernels()


def _inputs():
    positions = torch.tensor([5, 15, 40, 0, 9], dtype=torch.int64, device=DEVICE)
    context_lens = torch.tensor([6, 16, 35, 1, 31], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([21, 47, 102, -1, 78], dtype=torch.int64, device=DEVICE)  # row 3 pads the bucket
    block_tables = torch.tensor([[1, 7, 0], [2, 3, 9], [6, 4, 8], [0, 0, 0], [5, 2, 0]], dtype=torch.int32,
                                device=DEVICE)
    host_row = torch.tensor([1], dtype=torch.int64, device=DEVICE)
    return positions, context_lens, slots, block_tables, host_row


def test_advance_matches_the_reference_and_moves_each_live_row_one_token():
    expected, got = _inputs(), _inputs()
    advance_decode_inputs_ref(*expected[:4], 16, expected[4])
    advance_decode_inputs(*got[:4], 16, got[4])
    for e, g in zip(expected, got):
        assert torch.equal(e, g)
    positions, context_lens, slots, _, host_row = got
    assert positions.tolist() == [6, 16, 41, 0, 10]     # M-RoPE shifts (row 2) move along; padding stays
    assert context_lens.tolist() == [7, 17, 36, 1, 32]
    # Row 0: token 6 in block 1 (slot 22); row 1: token 16 opens table column 1 (block 3: slot 48); row 2: token 35,
    # column 2 (block 8: slot 131); row 4: token 31, column 1 (block 2: slot 47); padding keeps -1.
    assert slots.tolist() == [22, 48, 131, -1, 47]
    assert host_row.tolist() == [0]


def test_a_block_index_past_the_table_reads_its_last_column_and_twice_flips_back():
    positions, context_lens, slots, block_tables, host_row = _inputs()
    context_lens[0] = 48       # token 48 would be column 3 of a 3-column table
    advance_decode_inputs(positions, context_lens, slots, block_tables, 16, host_row)
    assert slots[0].item() == 0 * 16 + 0   # column 2 (block 0), slot 48 % 16 = 0: garbage the host never replays
    advance_decode_inputs(positions, context_lens, slots, block_tables, 16, host_row)
    assert host_row.tolist() == [1]


def test_advance_rejects_mismatched_rows():
    positions, context_lens, slots, block_tables, host_row = _inputs()
    with pytest.raises(ValueError, match="do not match"):
        advance_decode_inputs(positions, context_lens[:4], slots, block_tables, 16, host_row)
