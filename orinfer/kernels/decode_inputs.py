"""The decode graphs' inputs advanced by one token on the device, so that the next step needs no upload.

Each decode graph ends with this kernel. A row that decodes (slot >= 0; padding rows hold -1) moves to its next
token: position + 1, context length + 1, and the KV slot of token index ctx (the old length) from the row's block
table. The table itself is not touched: the host uploads again whenever that token's block is not in the table it
last uploaded (`DecodeGraphs.run`). The pinned host-ids row that the graphs' argmax writes flips (0 <-> 1), as it
does when the host uploads the other staging set.

Why: uploading the inputs before each replay (two small host -> device copies) left 12 us between batch-1 replays;
without them, 1 us, and one sequence of the bench's engine decodes at 573.8 tok/s instead of 569.9 (H200;
docs/performance.md).

Kernel: one program, rows [0, BLOCK); reads and writes 8 + 4 + 8 bytes per row, 4 bytes of table per row, and the
8-byte host-ids row index.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from orinfer.kernels.gemv import check_device
from orinfer.kernels.pdl import small_kernel_prologue, use_pdl


def advance_decode_inputs_ref(positions: torch.Tensor, context_lens: torch.Tensor, slots: torch.Tensor,
                              block_tables: torch.Tensor, block_size: int, host_row: torch.Tensor) -> None:
    """In place: for rows with slot >= 0, positions += 1, context_lens += 1, slots = the slot of token index
    (old context length) through the row's block table (its last column if the block index falls past the table);
    host_row[0] = 1 - host_row[0]."""
    live = slots >= 0
    token = context_lens.to(torch.int64)
    block = (token // block_size).clamp(max=block_tables.shape[1] - 1)
    table_block = block_tables.gather(1, block[:, None]).squeeze(1).to(torch.int64)
    new_slots = table_block * block_size + token % block_size
    positions.copy_(torch.where(live, positions + 1, positions))
    context_lens.copy_(torch.where(live, context_lens + 1, context_lens))
    slots.copy_(torch.where(live, new_slots, slots))
    host_row.copy_(1 - host_row)


@triton.jit
def _advance_kernel(pos_ptr, ctx_ptr, slot_ptr, table_ptr, row_ptr, n_rows, stride_table, n_blocks,
                    BS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # see kernels/pdl.py: wait for the previous kernel before touching memory
        small_kernel_prologue()
    i = tl.arange(0, BLOCK)
    slot = tl.load(slot_ptr + i, mask=i < n_rows, other=-1)
    live = slot >= 0
    pos = tl.load(pos_ptr + i, mask=live, other=0)
    ctx = tl.load(ctx_ptr + i, mask=live, other=0)
    token = ctx.to(tl.int64)
    block = tl.minimum(token // BS, n_blocks - 1)
    table_block = tl.load(table_ptr + i.to(tl.int64) * stride_table + block, mask=live, other=0).to(tl.int64)
    tl.store(pos_ptr + i, pos + 1, mask=live)
    tl.store(ctx_ptr + i, ctx + 1, mask=live)
    tl.store(slot_ptr + i, table_block * BS + token % BS, mask=live)
    tl.store(row_ptr, 1 - tl.load(row_ptr))


def advance_decode_inputs(positions: torch.Tensor, context_lens: torch.Tensor, slots: torch.Tensor,
                          block_tables: torch.Tensor, block_size: int, host_row: torch.Tensor) -> None:
    """`advance_decode_inputs_ref` in one kernel: positions [B] int64, context_lens [B] int32, slots [B] int64,
    block_tables [B, W] int32 (unit last stride), host_row [1] int64; all contiguous rows on one device. No host
    sync: graph-capturable."""
    check_device(positions)
    rows = positions.shape[0]
    if not (context_lens.shape == slots.shape == (rows,) and block_tables.shape[0] == rows
            and block_tables.stride(-1) == 1 and host_row.numel() == 1):
        raise ValueError("advance_decode_inputs: positions, context_lens, slots [B], block_tables [B, W] and "
                         "host_row [1] do not match")
    if rows == 0:
        return
    pdl = use_pdl(positions)
    _advance_kernel[(1,)](positions, context_lens, slots, block_tables, host_row, rows, block_tables.stride(0),
                          block_tables.shape[1], BS=block_size, BLOCK=triton.next_power_of_2(rows), num_warps=1,
                          PDL=pdl, launch_pdl=pdl)
