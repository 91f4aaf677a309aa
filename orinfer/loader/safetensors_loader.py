"""Reads Hugging Face safetensors checkpoints: one file, or shards listed in model.safetensors.index.json.

Files are memory-mapped by `safetensors`; each tensor is read once and copied into its (possibly packed) parameter,
so peak host memory stays near one tensor, not one model.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from orinfer.errors import OrinferError, WeightsError



@dataclass(frozen=True)
class Then:
    """A part of a tensor (any form `read_slice` takes), then `fn` applied to what was read (e.g. a transpose that
    gives a rank's part of a fused tensor the layout the model's loader expects)."""

    part: Any
    fn: Callable[[torch.Tensor], torch.Tensor]


# (name, shape) -> the part of a tensor to read: (dimension, first index, length), optionally with a function
# applied to that part once read, or a list of such ranges along one dimension to concatenate, or such a part
# wrapped in `Then`, or None for the whole tensor (distributed/sharding.py and slices.py make them).
Slicer = Callable[[str, tuple[int, ...]], "tuple | list[tuple[int, int, int]] | Then | None"]

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a model directory, in a stable order; raises WeightsError if there are none."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise WeightsError(f"{index}: not a valid safetensors index ({exc})") from None
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise WeightsError(f"{index} lists shard(s) that do not exist: {', '.join(absent)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        hint = " (PyTorch .bin checkpoints are not loaded: convert them to safetensors)" \
            if any(model_dir.glob("*.bin")) else ""
        raise WeightsError(f"no *.safetensors weights in {model_dir}{hint}")
    return files


def iter_safetensors(files: list[Path], device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                     progress: bool = True, desc: str = "Loading weights",
                     slicer: Slicer | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) for every tensor in `files`, converted to `dtype` and moved to `device`. `slicer`
    (tensor parallelism): (name, shape) -> the part of the tensor to read, for a rank that holds only that part
    (only those bytes are read from the file)."""
    total = 0
    names_by_file = []
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                names = list(handle.keys())
        except (SafetensorError, OSError, ValueError) as exc:
            raise WeightsError(f"{path}: cannot read safetensors file ({exc})") from None
        names_by_file.append((path, names))
        total += len(names)
    bar = tqdm(total=total, desc=desc, unit="tensor", disable=not progress, leave=False)
    try:
        for path, names in names_by_file:
            with safe_open(str(path), framework="pt") as handle:
                for name in names:
                    try:
                        part = None if slicer is None else slicer(name, tuple(handle.get_slice(name).get_shape()))
                        tensor = read_slice(handle, name, part)
                    except OrinferError:
                        raise  # the slicer's own error (a tensor the config's split does not fit) names the cause
                    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
                        raise WeightsError(f"{path}: tensor {name} is corrupt ({exc})") from None
                    if dtype is not None and tensor.is_floating_point():
                        tensor = tensor.to(dtype)
                    yield name, tensor.to(device)
                    bar.update(1)
    finally:
        bar.close()


def read_slice(handle, name: str, part: "tuple | list[tuple[int, int, int]] | Then | None") -> torch.Tensor:
    """Only `part` (dimension, first index, length[, function of the part]) of tensor `name` of an open safetensors
    file; a list of ranges: those parts, concatenated along their dimension; `Then`: its part, then its function;
    None: all of it."""
    if part is None:
        return handle.get_tensor(name)
    if isinstance(part, Then):
        return part.fn(read_slice(handle, name, part.part))
    if isinstance(part, list):
        return torch.cat([read_slice(handle, name, p) for p in part], dim=part[0][0])
    dim, start, length, *then = part
    tensor = handle.get_slice(name)[(slice(None),) * dim + (slice(start, start + length),)]
    return then[0](tensor) if then else tensor
