"""`quantize_checkpoint`: a Hugging Face Qwen directory in, an AWQ INT4 directory (AutoAWQ "gemm" format) out."""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from orinfer.config import ModelConfig, QuantConfig
from orinfer.errors import ConfigError
from orinfer.layers.ops import TORCH_OPS
from orinfer.loader import load_hf_model
from orinfer.quant.awq import awq_search
from orinfer.quant.rtn import quantize_rtn

log = logging.getLogger(__name__)

METHODS = ("awq", "rtn")
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Files copied unchanged next to the weights (whichever exist).
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
              "added_tokens.json", "chat_template.jinja", "chat_template.json", "generation_config.json")


def _is_linear_weight(name: str) -> bool:
    return name.endswith(".weight") and any(f".{linear}." in name for linear in LINEARS)


def quantize_checkpoint(in_dir: str | Path, out_dir: str | Path, method: str = "awq", group_size: int = 128,
                        calib_text: str | None = None, n_grid: int = 20, clip: bool = True,
                        device: str | torch.device | None = None, seq_len: int = 512, max_calib_tokens: int = 65536,
                        progress: bool = True) -> dict[str, Any]:
    """Quantizes the 7 decoder linears of every layer to 4 bits (groups of `group_size` inputs, zero points, fp16
    scales) and writes `out_dir`: config.json (+ quantization_config, torch_dtype float16), model.safetensors
    (qweight/qzeros/scales; embeddings, norms, biases and lm_head in fp16) and the tokenizer / generation files.

    method "rtn": round-to-nearest. "awq": activation-aware scales and clipping searched on `calib_text` (default:
    the bundled corpus; needs the model's tokenizer), folded into the preceding ops (see `quant.awq`).
    The search runs in fp32 with the torch backend on `device` (default: cuda if available). Returns a report.
    """
    started = time.perf_counter()
    in_dir, out_dir = Path(in_dir), Path(out_dir)
    if method not in METHODS:
        raise ConfigError(f"unknown quantization method {method!r}; use {' or '.join(METHODS)}")
    cfg = ModelConfig.from_hf(in_dir)
    if cfg.quantization is not None:
        raise ConfigError(f"{in_dir} is already quantized ({cfg.quantization.method}); quantize the original model")
    quant = QuantConfig(group_size=group_size)
    if group_size <= 0 and group_size != -1:
        raise ConfigError(f"--group-size must be positive (or -1: one group per row), got {group_size}")
    quant.check_model(cfg, source=f"{in_dir}/config.json with group_size {group_size}")
    if cfg.is_moe:  # the quantizer walks the model's linears; routed experts are no linears
        raise ConfigError(f"{in_dir} is a mixture-of-experts model ({cfg.architecture}); `orinfer quantize` does not "
                          "quantize MoE experts yet (AWQ / GPTQ MoE checkpoints made by other tools load as they are)")
    if out_dir.resolve() == in_dir.resolve():
        raise ConfigError("the output directory must differ from the input directory")
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_hf_model(in_dir, TORCH_OPS, torch.float32, torch.float32, dev, cfg, progress=progress)
    report: dict[str, Any] = {"method": method, "group_size": group_size}
    clips: dict[str, torch.Tensor] = {}
    if method == "awq":
        from orinfer.tokenizer import Tokenizer
        from orinfer.tokenizer_train import bundled_corpus

        tokenizer = Tokenizer.from_dir(in_dir)
        text = bundled_corpus() if calib_text is None else calib_text
        ids = tokenizer.encode(text)
        if len(ids) < 2:
            raise ConfigError("the calibration text is empty (fewer than 2 tokens)")
        result = awq_search(model, ids, group_size, n_grid=n_grid, clip=clip, seq_len=seq_len,
                            max_tokens=max_calib_tokens, progress=progress)
        clips = result.clips
        report.update(calib_tokens=min(len(ids), max_calib_tokens), alphas=result.alphas, losses=result.losses)
    tensors: dict[str, torch.Tensor] = {}
    state = list(model.hf_state_dict())
    for name, tensor in tqdm(state, desc=f"Quantizing ({method})", unit="tensor", disable=not progress,
                             leave=False):
        if _is_linear_weight(name):
            base = name[: -len(".weight")]
            group = tensor.shape[1] if group_size == -1 else group_size
            ql = quantize_rtn(tensor, group, clips.get(base))
            tensors[base + ".qweight"], tensors[base + ".qzeros"], tensors[base + ".scales"] = \
                ql.qweight.cpu(), ql.qzeros.cpu(), ql.scales.cpu()
        else:
            tensors[name] = tensor.detach().to(torch.float16).cpu().contiguous()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((in_dir / "config.json").read_text(encoding="utf-8"))
    raw["quantization_config"] = quant.to_hf_dict()
    raw["torch_dtype"] = "float16"
    if "dtype" in raw:
        raw["dtype"] = "float16"
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    for side in SIDE_FILES:
        if (in_dir / side).is_file():
            shutil.copyfile(in_dir / side, out_dir / side)
    report.update(seconds=time.perf_counter() - started, out_dir=str(out_dir),
                  bytes=sum(t.numel() * t.element_size() for t in tensors.values()))
    log.info("quantized %s -> %s (%s, group %d) in %.1f s", in_dir, out_dir, method, group_size, report["seconds"])
    return report
