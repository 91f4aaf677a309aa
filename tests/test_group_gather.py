"""`group.all_gather_columns` over a real gloo group of two CPU processes: the ranks' column blocks in rank order, in
the dtype asked for, and the vocab-parallel head's logits (gathered in the activation dtype, widened after) equal to
the whole head's fp32 logits."""

from __future__ import annotations

from pathlib import Path

import torch

from spawned_ranks import report_failure, run_spawned

WORLD = 2
DEADLINE_S = 120.0


def _block(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank `rank`'s [3, 5] block: values exact in bf16 that name their rank, row and column."""
    rows = torch.arange(3).unsqueeze(1) * 16 + torch.arange(5) + 100 * rank
    return rows.to(dtype)


def _rank_main(rank: int, store: str, out_dir: str) -> None:
    from orinfer.distributed import group
    from orinfer.layers.embedding import LMHead
    from orinfer.layers.ops import get_ops

    try:
        group.init_group(rank, WORLD, store, torch.device("cpu"), timeout_s=60.0)
        got = group.all_gather_columns(_block(rank, torch.bfloat16), out_dtype=torch.float32)
        want = torch.cat([_block(r, torch.float32) for r in range(WORLD)], dim=1)
        assert got.dtype == torch.float32 and torch.equal(got, want), (got, want)
        same = group.all_gather_columns(_block(rank, torch.bfloat16))
        assert same.dtype == torch.bfloat16 and torch.equal(same.float(), want)

        # An odd vocabulary: the last rank's rows end in padding, which the head cuts.
        vocab, hidden = 7, 8
        weight = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        head = LMHead(vocab, hidden, get_ops("torch", torch.device("cpu")), torch.bfloat16)
        head.weight.weight_loader(head.weight, weight[head.rows.first_row:head.rows.first_row + head.rows.num_rows])
        logits = head(x)
        assert logits.dtype == torch.float32 and logits.shape == (3, vocab)
        torch.testing.assert_close(logits, torch.nn.functional.linear(x, weight).float(), rtol=0, atol=0)
        group.destroy_group()
    except BaseException:  # noqa: BLE001 - reported to the test through the file
        report_failure(out_dir, rank)


def test_columns_gather_in_rank_order_and_widen(tmp_path: Path) -> None:
    store = f"file://{tmp_path / 'store'}"
    run_spawned(_rank_main, lambda rank: (rank, store, str(tmp_path)), WORLD, tmp_path, DEADLINE_S)
