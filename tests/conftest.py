"""pytest setup shared by all test files.

Without a CUDA device, Triton kernels run in Triton's CPU interpreter: TRITON_INTERPRET must be set before any module
defining a `@triton.jit` kernel is imported (the decorator picks interpreter or compiler at import time), and
pytest imports this file first.
"""

from __future__ import annotations

import os

# One CPU thread for torch, here and in the processes the tests start (`python -m orinfer`, make-tiny): the test models
# are tiny, so more threads gain little, and on a machine with few cores that is busy with other work OpenMP's spinning
# barriers make torch ops many times slower (on two loaded cores, a 30-token greedy generation: 5.6 s with two threads,
# 0.24 s with one; a make-tiny training step: 7 s against 0.5 s). An OMP_NUM_THREADS set by the caller is kept.
THREADS = os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(int(THREADS) if THREADS.isdigit() and int(THREADS) > 0 else 1)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_triton_interpreter_for_numpy_2_4() -> None:
    """Triton 3.6's interpreter turns scalar kernel arguments into 1-element arrays and converts them with int(),
    which numpy >= 2.4 refuses ("only 0-dimensional arrays can be converted"): every `for i in range(0, n, BLOCK)`
    with a runtime n fails. Re-install `tensor.__index__` with an explicit element read. Test-only shim."""
    try:
        import numpy as np
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_orinfer_patched", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    patched._orinfer_patched = True
    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_triton_interpreter_for_numpy_2_4()


# --- shared fixtures -----------------------------------------------------------------------------------------------

import itertools  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from collections import defaultdict  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

# tests/ holds helper modules (hf_models.py) imported by several test files.
sys.path.insert(0, str(Path(__file__).parent))


# --- test tiers: `make test` runs -m "not slow", `make test-slow` -m slow ---------------------------------------------

def _value_key(value: object) -> tuple[str, str]:
    return type(value).__qualname__, repr(value)


def pairwise_cover(cases: list[dict[str, object]]) -> list[int]:
    """Indices of a subset of `cases` (each a test's parameter values by name) in which every pair of values of two
    parameters that occurs in `cases` occurs at least once (with one parameter: every value). Greedy (the case that
    covers the most missing pairs, the first of equals), so the same cases give the same subset."""
    def pairs(params: dict[str, object]) -> set[tuple]:
        names = sorted(params)
        if len(names) == 1:
            return {(names[0], _value_key(params[names[0]]))}
        return {(a, _value_key(params[a]), b, _value_key(params[b])) for a, b in itertools.combinations(names, 2)}

    covers = [pairs(case) for case in cases]
    missing = set().union(*covers)
    chosen: list[int] = []
    while missing:
        best = max(range(len(cases)), key=lambda i: (len(covers[i] & missing), -i))
        chosen.append(best)
        missing -= covers[best]
    return chosen


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.pairwise` on a parametrized test: the default tier keeps the cases `pairwise_cover` picks from
    the collected ones (every pair of parameter values still meets in some case), the others get `slow`, so the slow
    tier runs the rest of the matrix."""
    matrices = defaultdict(list)
    for item in items:
        if item.get_closest_marker("pairwise") is not None and hasattr(item, "callspec"):
            matrices[(item.parent.nodeid, item.originalname)].append(item)
    for cases in matrices.values():
        keep = set(pairwise_cover([item.callspec.params for item in cases]))
        for i, item in enumerate(cases):
            if i not in keep:
                item.add_marker(pytest.mark.slow)


# --- the trained tiny model ------------------------------------------------------------------------------------------

TINY_ARGS = dict(arch="qwen3", train_steps=160, progress=False)
# make-tiny's training is the longest single piece of work of the run (about half a minute of one core). When the
# collected tests use `tiny_dir`, a child process makes the model while the tests before the first of them run.
_tiny_build: dict[str, object] = {}


def pytest_collection_finish(session):
    if session.config.option.collectonly or not any(
            "tiny_dir" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    out = Path(tempfile.mkdtemp(prefix="orinfer-tests-tiny-qwen3-"))
    log = open(out / "make_tiny.log", "w+")
    # The child inherits OMP_NUM_THREADS=1 (set above); make_tiny also trains on one thread whatever it is. It exits
    # when its stdin, a pipe nobody writes to, closes: when this process ends, however it ends.
    script = ("import json, os, sys, threading; "
              "threading.Thread(target=lambda: sys.stdin.read() or os._exit(1), daemon=True).start(); "
              "from orinfer.tiny import make_tiny; make_tiny(sys.argv[1], **json.loads(sys.argv[2]))")
    proc = subprocess.Popen([sys.executable, "-c", script, str(out / "model"), json.dumps(TINY_ARGS)],
                            stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT)
    _tiny_build.update(proc=proc, out=out, log=log)


def pytest_unconfigure(config):
    proc = _tiny_build.pop("proc", None)
    if proc is not None:
        if proc.poll() is None:  # the run ended (or was interrupted) before any test waited for it
            proc.kill()
            proc.wait()
        proc.stdin.close()
        _tiny_build.pop("log").close()
        shutil.rmtree(_tiny_build.pop("out"), ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A Qwen3 model made by `make-tiny` (trained 160 steps on the bundled text), shared by the whole run: from the
    child process `pytest_collection_finish` started, or made here when there is none."""
    proc = _tiny_build.get("proc")
    if proc is None:
        from orinfer.tiny import make_tiny

        return make_tiny(tmp_path_factory.mktemp("tiny-qwen3"), **TINY_ARGS)
    if proc.wait() != 0:
        log = _tiny_build["log"]
        log.seek(0)
        pytest.fail(f"make_tiny(**{TINY_ARGS}) failed in its child process (exit {proc.returncode}):\n{log.read()}")
    return _tiny_build["out"] / "model"


@pytest.fixture(scope="session")
def tiny_llm(tiny_dir):
    from orinfer import LLM

    return LLM(tiny_dir, dtype="float32", device="cpu", progress=False)
