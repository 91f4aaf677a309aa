"""The shared-model builder's waiters (tests/prebuilt.py): an attached waiter (an xdist worker) gets a built model's
folder, and fails with the child's error, or when the child is gone, instead of waiting forever."""

from __future__ import annotations

import subprocess
import sys

import pytest

from prebuilt import Prebuilt


def _dead_child_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_an_attached_waiter_gets_a_built_model(tmp_path):
    (tmp_path / "pid").write_text(str(_dead_child_pid()))
    (tmp_path / "tiny_dir.done").touch()
    assert Prebuilt.attach(tmp_path, ["tiny_dir"]).wait("tiny_dir") == tmp_path / "tiny_dir"


def test_an_attached_waiter_reads_the_childs_error(tmp_path):
    (tmp_path / "pid").write_text(str(_dead_child_pid()))
    (tmp_path / "failed").write_text("building tiny_dir:\nValueError: boom")
    with pytest.raises(RuntimeError, match="boom"):
        Prebuilt.attach(tmp_path, ["tiny_dir"]).wait("tiny_dir")


def test_an_attached_waiter_stops_when_the_child_died_unreaped(tmp_path):
    """A zombie (its parent has not waited on it yet) counts as gone."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        (tmp_path / "pid").write_text(str(child.pid))
        with pytest.raises(RuntimeError, match="gone"):
            Prebuilt.attach(tmp_path, ["tiny_dir"]).wait("tiny_dir")
    finally:
        child.wait()
