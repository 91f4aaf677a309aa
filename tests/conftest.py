"""pytest setup shared by all test files.

Without a CUDA device, Triton kernels run in Triton's CPU interpreter: TRITON_INTERPRET must be set before any module
defining a `@triton.jit` kernel is imported (the decorator picks interpreter or compiler at import time), and
pytest imports this file first.
"""

from __future__ import annotations

import os

import torch

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

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

# tests/ holds helper modules (hf_models.py) imported by several test files.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A Qwen3 model made by `make-tiny` (trained 160 steps on the bundled text), shared by the whole run."""
    from orinfer.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny-qwen3"), arch="qwen3", train_steps=160, progress=False)


@pytest.fixture(scope="session")
def tiny_llm(tiny_dir):
    from orinfer import LLM

    return LLM(tiny_dir, dtype="float32", device="cpu", progress=False)
