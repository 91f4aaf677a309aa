"""What every rank needs to build its shard of the model, and the one function that builds it (rank 0 and the
workers alike, so that their layers, runners and collectives match)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from orinfer.args import EngineArgs
from orinfer.config import ModelConfig
from orinfer.distributed.group import TensorParallelGroup
from orinfer.distributed.sharding import checkpoint_slicer, shard_config
from orinfer.layers.ops import Ops, get_ops


@dataclass
class ShardSource:
    """A model to split over the ranks (picklable: it goes to each worker process)."""

    config: ModelConfig              # the whole model's
    model_dir: str | None            # a HF directory; None: random weights of the config's shapes (benchmarks)
    weight_dtype: torch.dtype
    act_dtype: torch.dtype
    args: EngineArgs
    device_type: str                 # "cuda": rank r runs on cuda:r; "cpu": every rank on the CPU (gloo)
    seed: int = 0                    # random weights: rank r draws with seed + r

    def device(self, rank: int) -> torch.device:
        return torch.device("cuda", rank) if self.device_type == "cuda" else torch.device("cpu")

    def max_model_len(self) -> int:
        """The engine's context length (LLMEngine's rule), which sizes the runner's tables on every rank."""
        limit = self.config.max_position_embeddings
        return min(self.args.max_model_len or limit, limit)


@dataclass
class Shard:
    model: nn.Module
    config: ModelConfig              # this rank's shard's (heads and widths divided by the world size)
    ops: Ops
    device: torch.device


def build_shard(source: ShardSource, group: TensorParallelGroup) -> Shard:
    """This rank's shard: its slice of each checkpoint tensor, or random weights of its shapes."""
    from orinfer.loader import load_hf_model, random_model
    from orinfer.models.registry import model_class

    device = source.device(group.rank)
    ops = get_ops(source.args.backend, device, fused_ffn=source.args.fused_ffn)
    config = shard_config(source.config, group.world_size)
    if source.model_dir is None:
        model = random_model(config, ops, source.weight_dtype, source.act_dtype, device, seed=source.seed + group.rank)
    else:
        plan = model_class(source.config.architecture).tensor_parallel_plan
        model = load_hf_model(Path(source.model_dir), ops, source.weight_dtype, source.act_dtype, device, config,
                              progress=source.args.progress and group.rank == 0,
                              slicer=checkpoint_slicer(plan, source.config, group))
    if source.args.pre_dequant:  # every rank keeps its AWQ slices' 16-bit copy, as one process keeps the whole
        from orinfer.layers.awq_linear import pre_dequantize_model

        pre_dequantize_model(model, source.act_dtype)
    return Shard(model, config, ops, device)
