"""`orinfer.bench.fp8_accuracy` (issue 32's logit-error figure) on a tiny model on the CPU: the 16-bit twin carries the
FP8 model's dequantised weights (the torch backend dequantises FP8 to the activation dtype, so there both give the
same logits bit for bit), errors are measured against the fp32 twin, and the report renders."""

from __future__ import annotations

import dataclasses

import torch

from orinfer.bench import fp8_accuracy
from orinfer.config import preset


def test_fp8_accuracy_report_on_a_tiny_model():
    cfg = dataclasses.replace(preset("qwen3-0.6b"), hidden_size=256, intermediate_size=384, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=64, vocab_size=1024, num_hidden_layers=2)
    report = fp8_accuracy.measure(cfg, "tiny", 40, 4, torch.bfloat16, torch.device("cpu"), 0)
    rows = report["rows"]
    x16 = "FP8, x in 16 bits (ORINFER_FP8_ACTIVATIONS=16bit)"
    assert list(rows) == ["bfloat16 model", "FP8 (default paths)", x16]
    assert rows["FP8 (default paths)"] == rows["bfloat16 model"] == rows[x16]
    for part in ("prompt", "decode"):
        err = rows["bfloat16 model"][part]
        assert 0 < err["rms_err"] <= err["max_err"] < 0.2, err      # bf16's rounding: small, not zero
    text = fp8_accuracy.markdown(report)
    assert "| FP8 (default paths) |" in text and "Prompt 40 tokens, 4 decode steps" in text
