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


def _patch_triton_interpreter_fp8_rounding() -> None:
    """Triton 3.6's interpreter rounds fp32/fp16/bf16 -> float8e4nv by adding the cut-off bit to the mantissa without
    carrying into the exponent (-31.8 becomes -16, not -32) and rounds ties up, where the GPU's cvt.rn.satfinite
    rounds to nearest even. Convert those casts with torch instead (the GPU's rounding for values in range; the
    kernels clamp to +-448 first). Test-only shim."""
    try:
        import numpy as np
        from triton.runtime import interpreter
        import triton.language as tl
    except ImportError:
        return
    original = getattr(interpreter, "_convert_float", None)
    if original is None or getattr(original, "_orinfer_patched", False):
        return
    sources = {tl.float32: torch.float32, tl.float16: torch.float16, tl.bfloat16: torch.bfloat16}

    def patched(input, input_dtype, output_dtype, rounding_mode):
        if output_dtype == tl.float8e4nv and input_dtype in sources:
            src = torch.from_numpy(np.ascontiguousarray(input).view(np.uint8).copy())
            values = src.view(sources[input_dtype]).to(torch.float8_e4m3fn).view(torch.uint8)
            return values.numpy().reshape(input.shape)
        return original(input, input_dtype, output_dtype, rounding_mode)

    patched._orinfer_patched = True
    interpreter._convert_float = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_triton_interpreter_for_numpy_2_4()
    _patch_triton_interpreter_fp8_rounding()


# --- shared fixtures -----------------------------------------------------------------------------------------------

import itertools  # noqa: E402
import sys  # noqa: E402
from collections import defaultdict  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

# tests/ holds helper modules (hf_models.py) imported by several test files.
sys.path.insert(0, str(Path(__file__).parent))

from prebuilt import NAMES as PREBUILT_NAMES, Prebuilt, build as build_prebuilt  # noqa: E402


# --- test tiers (Makefile): `make test`, `make test-heavy`, `make test-slow`, `make test-matrix` by marker ------------

def _value_key(value: object) -> tuple[str, str]:
    return type(value).__qualname__, repr(value)


def pairwise_cover(cases: list[dict[str, object]], each_value: bool = False) -> list[int]:
    """Indices of a subset of `cases` (each a test's parameter values by name) in which every pair of values of two
    parameters that occurs in `cases` occurs at least once (with one parameter, or `each_value`: every value of each
    parameter). Greedy (the case that covers the most missing pairs, the first of equals), so the same cases give the
    same subset."""
    def pairs(params: dict[str, object]) -> set[tuple]:
        names = sorted(params)
        if len(names) == 1 or each_value:
            return {(name, _value_key(params[name])) for name in names}
        return {(a, _value_key(params[a]), b, _value_key(params[b])) for a, b in itertools.combinations(names, 2)}

    covers = [pairs(case) for case in cases]
    missing = set().union(*covers)
    chosen: list[int] = []
    while missing:
        best = max(range(len(cases)), key=lambda i: (len(covers[i] & missing), -i))
        chosen.append(best)
        missing -= covers[best]
    return chosen


def _listed_cases(name: str) -> frozenset[str]:
    """The node ids listed in tests/`name` (scripts/cpu_slow_cases.py makes the lists from a JUnit report)."""
    lines = (Path(__file__).parent / name).read_text().splitlines()
    return frozenset(node for node in (line.split("#")[0].strip() for line in lines) if node)


_CPU_SLOW_CASES = _listed_cases("cpu_slow_cases.txt")     # measured too slow for CI: the slow tier
_CPU_HEAVY_CASES = _listed_cases("cpu_heavy_cases.txt")   # CI runs them after the default tier


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    """The tests listed in cpu_slow_cases.txt get `slow`, those in cpu_heavy_cases.txt (a node id, or a file: all its
    tests) `heavy`, and so does every test of a prebuilt model (tests/prebuilt.py: a trained model, minutes of one
    core to make), so that the default tier starts no build at all.
    `@pytest.mark.pairwise` on a parametrized test: the default tier keeps the cases `pairwise_cover` picks from the
    collected ones (every pair of parameter values still meets in some case), the others get `slow`, so the slow
    tier runs the rest of the matrix.
    `@pytest.mark.pairwise(each_value=True)`, for the costliest interpreter matrices: the default tier keeps only
    enough cases for every value of each parameter to run once, the slow tier the cases of a pairwise cover, and the
    rest of the matrix gets `matrix` too (`make test-matrix`, and the GPU runs of these files, where a case takes
    milliseconds)."""
    for item in items:
        if item.nodeid in _CPU_SLOW_CASES:
            item.add_marker(pytest.mark.slow)
        if item.nodeid in _CPU_HEAVY_CASES or item.nodeid.split("::")[0] in _CPU_HEAVY_CASES or _prebuilt_uses(item):
            item.add_marker(pytest.mark.heavy)
    matrices = defaultdict(list)
    for item in items:
        if item.get_closest_marker("pairwise") is not None and hasattr(item, "callspec"):
            matrices[(item.parent.nodeid, item.originalname)].append(item)
    for cases in matrices.values():
        each_value = cases[0].get_closest_marker("pairwise").kwargs.get("each_value", False)
        params = [item.callspec.params for item in cases]
        keep = set(pairwise_cover(params, each_value))
        pairs = set(pairwise_cover(params)) if each_value else set(range(len(cases)))
        for i, item in enumerate(cases):
            if i not in keep:
                item.add_marker(pytest.mark.slow)
                if i not in pairs:
                    item.add_marker(pytest.mark.matrix)


# --- the shared models, made in the background (tests/prebuilt.py) ---------------------------------------------------

_prebuilt: list[Prebuilt] = []   # the child process building them, once tests need any


def _prebuilt_uses(item) -> set[str]:
    return set(getattr(item, "fixturenames", ())) & set(PREBUILT_NAMES)


def _model_files_last(items: list) -> None:
    """Reorders `items` in place: the files of which a test uses a prebuilt model after the others, each file's tests
    kept together and in their order (module fixtures are made once). Measured on the 2-core box: the first test of
    make-tiny's model waited 63 s for it (test_awq, third file of the run), while about 4 minutes of tests need no
    model."""
    files = {item.nodeid.split("::")[0] for item in items if _prebuilt_uses(item)}
    items.sort(key=lambda item: item.nodeid.split("::")[0] in files)  # stable: the order within each group stays


# Under pytest-xdist (`make test-heavy` runs two workers) the controller starts the child for every prebuilt model
# when its -m expression can select their (heavy) tests: it collects no tests, so it cannot tell which are needed. The
# workers wait on its folder, named by this variable.
_SHARED_PREBUILT = "ORINFER_TEST_PREBUILT_DIR"


def _is_xdist_controller(config) -> bool:
    return bool(getattr(config.option, "numprocesses", None)) and not hasattr(config, "workerinput")


def _may_select_heavy(config) -> bool:
    """Whether the run's -m expression can select a `heavy` test (every test of a prebuilt model is one), whatever
    other tier markers it has."""
    markexpr = config.option.markexpr
    if not markexpr:
        return True
    from _pytest.mark.expression import Expression

    expression = Expression.compile(markexpr)
    tiers = ("slow", "matrix", "pairwise", "gpu")
    return any(expression.evaluate(lambda name, **_: name == "heavy" or name in chosen)
               for n in range(len(tiers) + 1) for chosen in itertools.combinations(tiers, n))


def pytest_configure(config):
    if _is_xdist_controller(config) and not config.option.collectonly and _may_select_heavy(config):
        _prebuilt.append(Prebuilt(list(PREBUILT_NAMES)))
        os.environ[_SHARED_PREBUILT] = str(_prebuilt[0].root)  # the workers start after this, with this environment


@pytest.hookimpl(tryfirst=True)  # before xdist's worker sends the collected order to the controller
def pytest_collection_finish(session):
    needed = set().union(*map(_prebuilt_uses, session.items))
    if session.config.option.collectonly or not needed:
        return
    _model_files_last(session.items)
    shared = os.environ.get(_SHARED_PREBUILT)
    if shared and hasattr(session.config, "workerinput"):
        _prebuilt.append(Prebuilt.attach(Path(shared), list(PREBUILT_NAMES)))
    else:
        _prebuilt.append(Prebuilt([name for name in PREBUILT_NAMES if name in needed]))


def pytest_unconfigure(config):
    while _prebuilt:
        _prebuilt.pop().close()


def _model(name: str, tmp_path_factory) -> Path:
    """The prebuilt model `name`: from the child process, or made here when there is none (or it does not make it)."""
    if _prebuilt and name in _prebuilt[0].names:
        try:
            return _prebuilt[0].wait(name)
        except RuntimeError as exc:
            pytest.fail(str(exc))
    out = tmp_path_factory.mktemp(name) / name
    build_prebuilt(name, out)
    return out


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A Qwen3 model made by `make-tiny` (trained 160 steps on the bundled text), shared by the whole run."""
    return _model("tiny_dir", tmp_path_factory)


@pytest.fixture(scope="session")
def tool_dirs(tmp_path_factory):
    """The tool-calling models of tool_model.py ("json", "xml": the same weights under two chat templates)."""
    from tool_model import TEMPLATES

    root = _model("tool_dirs", tmp_path_factory)
    return {kind: root / kind for kind in TEMPLATES}


@pytest.fixture(scope="session")
def tiny_llm(tiny_dir):
    from orinfer import LLM

    return LLM(tiny_dir, dtype="float32", device="cpu", progress=False)
