"""Prompt-lookup (n-gram) drafts: no weights, wins where the answer repeats its context (editing, summarising, code).

The draft for a sequence is the up to k tokens that followed an earlier occurrence of its last n tokens, for the
largest n in [min_n, max_n] that occurs, at its latest occurrence (recent context predicts best). A continuation that
runs into the end of the context goes on with the draft itself (what would follow if the drafts are accepted), so a
short repeating pattern gets all k tokens.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def ngram_draft(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """tokens [L] int -> up to k draft token ids ([] when no n-gram of the tail occurs earlier)."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows that start at i with i + n < length: each is followed by at least one token.
        windows = sliding_window_view(tokens[:length - 1], n)
        starts = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if starts.size == 0:
            continue
        follow = int(starts[-1]) + n
        draft = tokens[follow:follow + k].tolist()
        while len(draft) < k:  # past the end: the continuation repeats with period length - follow
            draft.append(draft[len(draft) - (length - follow)])
        return draft
    return []


class TokenArrays:
    """Each sequence's token ids as a numpy array, grown in place as tokens are appended (no O(L) copy per step)."""

    def __init__(self) -> None:
        self._arrays: dict[int, tuple[np.ndarray, int]] = {}

    def of(self, seq_id: int, token_ids: list[int]) -> np.ndarray:
        """The array of `token_ids` (a list that only ever grows, or restarts shorter after a reset)."""
        array, filled = self._arrays.get(seq_id, (np.empty(0, dtype=np.int64), 0))
        length = len(token_ids)
        if length < filled:  # not the same list any more: start over
            filled = 0
        if length > array.size:
            grown = np.empty(max(2 * array.size, length, 64), dtype=np.int64)
            grown[:filled] = array[:filled]
            array = grown
        if length > filled:
            array[filled:length] = token_ids[filled:length]
        self._arrays[seq_id] = (array, length)
        return array[:length]

    def keep_only(self, seq_ids: set[int]) -> None:
        """Forgets the arrays of every other sequence."""
        for seq_id in [s for s in self._arrays if s not in seq_ids]:
            del self._arrays[seq_id]
