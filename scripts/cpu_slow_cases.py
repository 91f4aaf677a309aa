"""Lists the default tier's tests that took longer than a bound on the CPU, for tests/cpu_heavy_cases.txt or
tests/cpu_slow_cases.txt.

The default tier must end in minutes on CI's 2-core machine. Tests whose cost is the Triton interpreter or a large
engine set-up leave it by measurement rather than by hand: conftest.py marks every node id in cpu_heavy_cases.txt
`heavy` (`make test-heavy`, which CI runs right after the default tier) and every one in cpu_slow_cases.txt `slow`
(the slow tier, not in CI). Regenerate a list from a JUnit report of a default-tier run on a CI-like machine (`make
test` with `PYTEST_ADDOPTS=--junitxml=report.xml`), merging with the ids already listed (those no longer run in the
default tier):

    python scripts/cpu_slow_cases.py report.xml --over 2 >> tests/cpu_heavy_cases.txt

A test's time in the report includes its fixtures' set-up: moving the first test of a module that builds an engine
moves that set-up onto the next one, which the next regeneration may then list. Where a module's first test pays a
module-wide cost (compiling kernels), list the file instead (a line without `::`): conftest.py then marks all its
tests. Tests of the trained prebuilt models (tests/prebuilt.py) are heavy without being listed.
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from pathlib import Path


def slow_cases(report: Path, over: float) -> list[tuple[float, str]]:
    """(seconds, node id) of each test in a JUnit report that ran (not skipped) longer than `over` seconds."""
    cases = []
    for case in ET.parse(report).getroot().iter("testcase"):
        if case.find("skipped") is not None or float(case.get("time", 0.0)) <= over:
            continue
        module = case.get("classname", "").split(".")
        path = "/".join(module[:-1] + [module[-1] + ".py"]) if module else ""
        cases.append((float(case.get("time")), f"{path}::{case.get('name')}"))
    return sorted(cases, reverse=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", type=Path, help="a JUnit XML report of a default-tier run")
    parser.add_argument("--over", type=float, default=10.0, help="seconds a test may take in the default tier")
    args = parser.parse_args(argv)
    for seconds, node in slow_cases(args.report, args.over):
        print(f"{node}  # {seconds:.0f} s")


if __name__ == "__main__":
    main()
