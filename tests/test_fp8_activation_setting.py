"""ORINFER_FP8_ACTIVATIONS (kernels/fp8_quant.py): "16bit" makes every FP8 path keep x in 16 bits (the dense
layers' decode batches and prefill, the experts' prefill), "dynamic" (the default) quantizes x where W8A8 pays; the
three specific settings still override it; any other value is refused, naming the variable, when an FP8 model is
built. Each case runs a fresh interpreter, as the settings are read at import."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = ("from orinfer.kernels import fp8_ops, moe_a8; "
         "print(fp8_ops.SMALL_M, fp8_ops.PREFILL, moe_a8.MODE)")


def settings(**env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ORINFER_FP8_")}
    return subprocess.run([sys.executable, "-c", PROBE], env={**clean, "TRITON_INTERPRET": "1", **env},
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("env, want", [
    ({}, "w8a8 auto w8a8"),
    ({"ORINFER_FP8_ACTIVATIONS": "dynamic"}, "w8a8 auto w8a8"),
    ({"ORINFER_FP8_ACTIVATIONS": "16bit"}, "w8a16 dequant w8a16"),
    ({"ORINFER_FP8_ACTIVATIONS": "16bit", "ORINFER_FP8_PREFILL": "w8a16"}, "w8a16 w8a16 w8a16"),
])
def test_the_setting_picks_the_paths_defaults(env, want):
    done = settings(**env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == want.split()


def test_an_unknown_value_is_named_when_an_fp8_model_loads(tiny_dir):
    """The CLI's error line, not a traceback: `orinfer generate --quantization fp8` on the tiny checkpoint."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ORINFER_FP8_")}
    done = subprocess.run([sys.executable, "-m", "orinfer", "generate", "-m", str(tiny_dir), "--device", "cpu",
                           "--quantization", "fp8", "-p", "hi", "--max-tokens", "1"],
                          env={**clean, "ORINFER_FP8_ACTIVATIONS": "fp16"}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == ("error: ORINFER_FP8_ACTIVATIONS='fp16': expected 'dynamic' (the "
                                                    "default) or '16bit'")
    assert "Traceback" not in done.stderr
