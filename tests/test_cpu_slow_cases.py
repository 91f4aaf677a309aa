"""The measured tiering: scripts/cpu_slow_cases.py reads a JUnit report, and conftest.py marks the listed tests slow
(cpu_slow_cases.txt) or heavy (cpu_heavy_cases.txt)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from conftest import _CPU_HEAVY_CASES, _CPU_SLOW_CASES, _may_select_heavy, pytest_collection_modifyitems

ROOT = Path(__file__).parent.parent
REPORT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_a" name="test_fast" time="0.5" />
<testcase classname="tests.test_a" name="test_slow[dtype0-16]" time="74.1" />
<testcase classname="tests.test_b" name="test_skipped" time="99.0"><skipped message="needs CUDA" /></testcase>
<testcase classname="tests.test_b" name="test_medium" time="12.0" />
</testsuite></testsuites>"""


def _script():
    spec = importlib.util.spec_from_file_location("cpu_slow_cases", ROOT / "scripts" / "cpu_slow_cases.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lists_the_tests_over_the_bound_slowest_first_without_skipped_ones(tmp_path):
    report = tmp_path / "report.xml"
    report.write_text(REPORT)
    assert _script().slow_cases(report, 10.0) == [(74.1, "tests/test_a.py::test_slow[dtype0-16]"),
                                                  (12.0, "tests/test_b.py::test_medium")]
    assert _script().slow_cases(report, 100.0) == []


def test_every_listed_test_names_a_test_file_that_exists():
    assert _CPU_SLOW_CASES and _CPU_HEAVY_CASES
    for node in _CPU_SLOW_CASES | _CPU_HEAVY_CASES:
        path, _, name = node.partition("::")
        whole_file = node in _CPU_HEAVY_CASES and not name  # (the heavy list may name a file: all its tests)
        assert (ROOT / path).is_file() and (whole_file or name.startswith("test_")), node


def test_a_file_in_the_heavy_list_makes_each_of_its_tests_heavy():
    files = sorted(node for node in _CPU_HEAVY_CASES if "::" not in node)
    assert files
    inside, outside = _Item(f"{files[0]}::test_any[case]"), _Item("tests/test_cpu_slow_cases.py::test_not_listed")
    pytest_collection_modifyitems(None, [inside, outside])
    assert inside.markers == ["heavy"] and outside.markers == []


class _Item:
    """What the tiering hook reads of a collected test: its id and markers."""

    def __init__(self, nodeid: str, fixturenames: tuple[str, ...] = ()) -> None:
        self.nodeid, self.markers, self.fixturenames = nodeid, [], fixturenames

    def add_marker(self, marker) -> None:
        self.markers.append(marker.name)

    def get_closest_marker(self, name: str):
        return name if name in self.markers else None


def test_the_collection_hook_marks_listed_tests_slow_or_heavy_and_no_others():
    slow, heavy = _Item(sorted(_CPU_SLOW_CASES)[0]), _Item(sorted(_CPU_HEAVY_CASES)[0])
    other = _Item("tests/test_cpu_slow_cases.py::test_not_listed")
    pytest_collection_modifyitems(None, [slow, heavy, other])
    assert slow.markers == ["slow"] and heavy.markers == ["heavy"] and other.markers == []


def test_every_test_of_a_prebuilt_model_is_heavy():
    """A trained prebuilt model takes minutes of one core to make: its tests leave the default tier whole."""
    direct = _Item("tests/test_x.py::test_a", ("tmp_path", "tiny_dir"))
    through_a_fixture = _Item("tests/test_x.py::test_b", ("tiny_llm", "tiny_dir", "request"))
    tools = _Item("tests/test_x.py::test_c", ("tool_dirs",))
    other = _Item("tests/test_x.py::test_d", ("tmp_path",))
    pytest_collection_modifyitems(None, [direct, through_a_fixture, tools, other])
    assert [item.markers for item in (direct, through_a_fixture, tools, other)] == [["heavy"]] * 3 + [[]]


class _Config:
    def __init__(self, markexpr: str) -> None:
        self.option = type("Option", (), {"markexpr": markexpr})()


def test_prebuilt_models_are_made_only_for_runs_that_can_select_heavy_tests():
    selects = {expr: _may_select_heavy(_Config(expr)) for expr in
               ("", "not slow and not heavy", "heavy and not slow", "slow and not matrix", "matrix", "gpu",
                "not heavy")}
    assert selects == {"": True, "not slow and not heavy": False, "heavy and not slow": True,
                       "slow and not matrix": True, "matrix": True, "gpu": True, "not heavy": False}
