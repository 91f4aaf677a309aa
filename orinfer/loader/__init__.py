"""Loading models: from Hugging Face directories, or with random weights of a given shape."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from orinfer.config import ModelConfig
from orinfer.errors import ConfigError
from orinfer.fp8_config import FP8Config
from orinfer.kernels.gptq import pack_gptq_cols
from orinfer.layers.gptq_linear import GPTQLinear
from orinfer.layers.ops import Ops
from orinfer.loader.safetensors_loader import Slicer, checkpoint_files, iter_safetensors
from orinfer.moe_config import check_moe_weights
from orinfer.models.registry import build_model

log = logging.getLogger(__name__)


def load_hf_model(model_dir: str | Path, ops: Ops, weight_dtype: torch.dtype, act_dtype: torch.dtype,
                  device: torch.device, config: ModelConfig | None = None, progress: bool = True,
                  slicer: Slicer | None = None) -> nn.Module:
    """Builds the model for `model_dir`'s config.json and fills it from its safetensors files. `slicer` (a tensor-
    parallel rank, whose `config` is its shard's): which part of each tensor it reads."""
    config = config or ModelConfig.from_hf(model_dir)
    if config.quantization is not None:
        config.quantization.check_loadable(config)
    files = checkpoint_files(model_dir)  # fail on missing weights before allocating anything
    model = build_model(config, ops, weight_dtype, act_dtype, device)
    online = getattr(config.quantization, "online", False)
    desc = "Loading weights (quantizing to FP8)" if online else "Loading weights"
    model.load_weights(iter_safetensors(files, device=device, progress=progress, desc=desc, slicer=slicer))
    finish_loading(model)
    return model


def online_format(method: str) -> FP8Config:
    """The weight format that `--quantization method` makes of 16/32-bit weights while loading (today: "fp8",
    block-wise FP8 with 128x128 blocks); ConfigError for another method."""
    if method != "fp8":
        raise ConfigError(f"quantization={method!r} is not supported; orinfer quantizes while loading to: fp8")
    return FP8Config(online=True)


def online_quantization(config: ModelConfig, method: str, source: str = "model") -> ModelConfig:
    """`config` with the weight format that `--quantization method` makes of a 16/32-bit checkpoint while loading
    (`online_format`). ConfigError for a checkpoint that is already quantized."""
    quant = online_format(method)
    if config.quantization is not None:
        raise ConfigError(f"{source} is already quantized ({config.quantization.method}); quantization={method!r} "
                          "applies to 16/32-bit checkpoints")
    quantized = dataclasses.replace(config, quantization=quant)
    check_moe_weights(quantized, source)
    return quantized


def finish_loading(model: nn.Module) -> None:
    """Lets layers convert what they loaded into the layout they run on (AWQ -> W4 repacking), once."""
    for module in model.modules():
        if hasattr(module, "finish_loading") and module is not model:
            module.finish_loading()


def random_model(config: ModelConfig, ops: Ops, weight_dtype: torch.dtype, act_dtype: torch.dtype,
                 device: torch.device, seed: int = 0, std: float = 0.02) -> nn.Module:
    """A model of `config`'s shapes with random weights made on the device (speed depends on shapes only)."""
    model = build_model(config, ops, weight_dtype, act_dtype, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dtype == torch.float8_e4m3fn:  # FP8 codes ~ N(0, 1) (scales of std: below)
                param.copy_(torch.randn(param.shape, generator=gen, device=device).clamp_(-448, 448))
            elif name.endswith("scale_inv"):  # FP8 block scales (linears' weight_scale_inv, experts' w13_scale_inv)
                param.fill_(std)
            elif param.dtype == torch.int32:  # packed nibbles / bytes: any bits are valid codes (GPTQ: below)
                param.random_(generator=gen)
            elif name.endswith(".scales"):
                param.fill_(std / 6)
            elif name.endswith(".weight") and "norm" in name.rsplit(".", 2)[-2]:  # RMSNorm / LayerNorm scales
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, std, generator=gen)
        for name, buffer in model.named_buffers():
            if name.endswith("scale_inv"):  # online FP8's block scales are buffers (the loader fills them)
                buffer.fill_(std)
        for module in model.modules():
            if isinstance(module, GPTQLinear):
                _symmetric_gptq(module, std, gen)
            elif hasattr(module, "randomize"):  # a layer whose random bits need a format's rules (W4 experts)
                module.randomize(std, gen)
    finish_loading(model)
    return model


def _symmetric_gptq(layer: GPTQLinear, std: float, gen: torch.Generator) -> None:
    """A valid symmetric GPTQ layer of random codes: codes uniform over all 2^b values (random_'s default range
    leaves the sign bit 0, which would bias the top code of each word), zero points 2^(b-1), plain group order,
    scales giving weights of about `std`."""
    layer.qweight.random_(-2**31, 2**31 - 1, generator=gen)
    groups, k = layer.scales.shape[0], layer.in_features
    zero = 2 ** (layer.bits - 1)
    layer.qzeros.copy_(pack_gptq_cols(torch.full((groups, layer.out_features), zero - 1, dtype=torch.int32,
                                                 device=layer.qzeros.device), layer.bits))
    layer.g_idx.copy_((torch.arange(k, device=layer.g_idx.device) * groups // k).expand_as(layer.g_idx))
    layer.scales.fill_(std / (0.58 * zero))  # a uniform code's deviation from the zero point is ~0.58 * zero


def read_generation_config(model_dir: str | Path) -> dict[str, Any]:
    """generation_config.json as a dict ({} when absent)."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from None
    return data if isinstance(data, dict) else {}
