"""The default tier's subset of a `@pytest.mark.pairwise` matrix (conftest.py) leaves no pair of parameter values out
(with each_value=True: no value of any parameter)."""

from __future__ import annotations

import itertools

import pytest

from conftest import pairwise_cover


def _pairs(cases: list[dict]) -> set[tuple]:
    return {(a, repr(case[a]), b, repr(case[b])) for case in cases for a, b in itertools.combinations(sorted(case), 2)}


@pytest.mark.parametrize("axes", [
    {"kernel": ["fp", "int"], "cfg": [0, 1, 2, 3, None], "gated": [False, True], "k": [384, 512]},
    {"dtype": ["f32", "f16", "bf16"], "rows": [2, 7, 16, 17, 40], "cfg": [0, 1, 2, 3, 4], "gated": [False, True]},
    {"a": [1, 2], "b": [1, 2]},
])
def test_every_pair_of_values_is_kept(axes):
    cases = [dict(zip(axes, values)) for values in itertools.product(*axes.values())]
    chosen = pairwise_cover(cases)
    assert len(set(chosen)) == len(chosen) and chosen == pairwise_cover(cases)   # no repeats; deterministic
    assert _pairs([cases[i] for i in chosen]) == _pairs(cases)
    largest = sorted(len(v) for v in axes.values())[-2:]
    assert len(chosen) < len(cases) or len(axes) == 2
    assert len(chosen) >= largest[0] * largest[1]


def test_joint_values_and_a_single_parameter():
    """Values given together (one parametrize over two names) pair only as they occur; one parameter: every value."""
    cases = [{"kernel": kernel, "dtype": dtype, "gated": gated}
             for kernel, dtype in [("fp", "f32"), ("fp", "bf16"), ("int", "bf16")] for gated in (False, True)]
    chosen = [cases[i] for i in pairwise_cover(cases)]
    assert _pairs(chosen) == _pairs(cases)
    assert pairwise_cover([{"x": 1}, {"x": 2}, {"x": 1}]) == [0, 1]


def test_each_value_keeps_every_value_of_each_parameter_once_at_least():
    axes = {"dtype": ["f32", "f16", "bf16"], "rows": [2, 7, 16, 17, 40], "cfg": [0, 1, 2, 3, 4], "gated": [False, True]}
    cases = [dict(zip(axes, values)) for values in itertools.product(*axes.values())]
    chosen = [cases[i] for i in pairwise_cover(cases, each_value=True)]
    assert len(chosen) == 5                                    # the largest parameter's values, no more
    for name, values in axes.items():
        assert {case[name] for case in chosen} == set(values)


def test_each_value_matrices_keep_a_pairwise_cover_out_of_the_matrix_marker():
    """The slow tier (`slow and not matrix`) and the default tier together still meet every pair of values of an
    each_value matrix; `matrix` only takes cases beyond that cover."""
    axes = {"kernel": ["fp", "int"], "cfg": [0, 1, 2, 3, None], "gated": [False, True], "k": [384, 512]}
    cases = [dict(zip(axes, values)) for values in itertools.product(*axes.values())]
    default = set(pairwise_cover(cases, each_value=True))
    pairs = set(pairwise_cover(cases))
    assert _pairs([cases[i] for i in default | pairs]) == _pairs(cases)
    assert len(default | pairs) < len(cases)
