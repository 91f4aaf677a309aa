"""orinfer/tool_calls/json_scan.py: the incremental strict-JSON scanner agrees with json.loads (without its NaN and
Infinity extensions) on valid and invalid texts fed in any pieces, and at every prefix of a text the part up to its
safe place plus the closing it gives is valid JSON."""

from __future__ import annotations

import json
import random

import pytest

from orinfer.tool_calls.json_call import object_text
from orinfer.tool_calls.json_scan import JsonScanner

DOCS = [
    '{"a": 1, "b": [true, false, null, -0.5e+3, "x\\"y\\\\z\\u00e9\\ud83d\\ude00"], "c": {"d": {}}, "e": []}',
    '[1,2 , 3]', '"str"', "12", "-0", "0.5E-7", " {\"a\":[ ]} ", "[[[[]]]]", '{"é": "日本", "k": "\\/"}', "true",
    '"\\ud800 lone"',
    # invalid
    '{"a":"\\u12"}', '{"a": 01}', '{"a": 1.}', '{"a": tru}', '{"a": NaN}', '{"a": Infinity}', '{"a": "x\ny"}',
    '{"a" 1}', '{"a": 1,}', "[1,]", "{,}", '{"a": 1} x', "[}", "{]", '"\\x"', "-", "1e", "1e+", '{"a": 1 2}',
    "nul", "", "  ", '{"a": 1-2}', "[.5]", "{'a': 1}", '{"a": 1}}',
]


def _strict_loads(text: str) -> bool:
    def no_constant(name):
        raise ValueError(name)
    try:
        json.loads(text, parse_constant=no_constant)
        return True
    except ValueError:
        return False


def _scan(text: str, cuts: list[int]) -> JsonScanner:
    scanner = JsonScanner(report_depth=99)
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        scanner.feed(text[a:b])
    scanner.end()
    return scanner


@pytest.mark.parametrize("text", DOCS)
def test_scanner_agrees_with_json_loads_for_any_split(text):
    expected = _strict_loads(text)
    rng = random.Random(len(text))
    splits = [[], list(range(1, len(text)))]
    splits += [sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1))) for _ in range(30)
               if len(text) > 1]
    for cuts in splits:
        assert _scan(text, cuts).done == expected


@pytest.mark.parametrize("text", [d for d in DOCS if d.lstrip()[:1] in ("{", "[")])
def test_safe_place_closes_into_valid_json(text):
    whole = _scan(text, [])
    for k in range(1, len(text) + 1):
        scanner = JsonScanner()
        scanner.feed(text[:k])
        if scanner.stack or scanner.safe_in_string:   # an open value: the cut and its closing parse
            assert _strict_loads(text[:scanner.safe] + scanner.closing()), text[:k]
        if whole.error_at >= 0 and k <= whole.error_at:
            assert not scanner.error   # the error is found at its character, not before


def test_events_of_the_top_level_object():
    scanner = JsonScanner(report_depth=1)
    text = '{"k": [1, {"x": 2}], "s": "v"}'
    scanner.feed(text)
    spans = [(kind, depth, text[start:end] if kind == "key" else start if end < 0 else end)
             for kind, depth, start, end in scanner.events]
    assert spans == [("value-start", 0, 0), ("key", 1, '"k"'), ("value-start", 1, 6), ("value-end", 1, 19),
                     ("key", 1, '"s"'), ("value-start", 1, 26), ("value-end", 1, 29), ("value-end", 0, 30)]


def test_object_text():
    assert object_text(' {"a": 1}\n') == '{"a": 1}' and object_text("  ") == "{}"
    assert object_text("[1]") is None and object_text('{"a": }') is None and object_text('{"a": NaN}') is None
