"""The seed engine's single-file `.bin` model format (Qwen3): export from a HF directory, load through mmap.

Layout (little-endian; `docs/formats.md` has the full description):
  header, 256 bytes: magic u32 0x616b3438 ("ak48") | version i32 (5: AWQ INT4, 6: FP16 variant) | dim, hidden_dim,
  n_layers, n_heads, n_kv_heads, vocab_size, max_seq_len (7 x i32) | shared_classifier u8 | head_dim i32 (at 0x25,
  unaligned) | group_size i32 (at 0x29; 0 in the FP16 variant) | zero padding, in which orinfer stores at 0x40 an
  optional extension the seed's reader ignores: b"orx1", rope_theta f64, rms_norm_eps f64, bos i32 (-1: none),
  n_eos i32, eos i32[8].
  body, in this fixed order, each tensor row-major with no padding:
    A  input_layernorm x L [dim] fp16, post_attention_layernorm x L [dim] fp16, norm [dim] fp16,
       embed_tokens [vocab, dim] fp16
    B  for wq, wk, wv, wo, w1 (gate), w2 (down), w3 (up), each for layers 0..L-1:
         AWQ (v5): qweight [in, out/8] i32, qzeros [in/G, out/8] i32, scales [in/G, out] fp16
         FP16 (v6): weight [out, in] fp16 (the HF layout)
    C  lm_head [vocab, dim] fp16 (only when shared_classifier == 0), q_norm x L [head_dim], k_norm x L [head_dim]
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from torch import nn

from orinfer.config import ModelConfig, QuantConfig
from orinfer.errors import ConfigError, WeightsError
from orinfer.layers.ops import Ops
from orinfer.loader.safetensors_loader import checkpoint_files

MAGIC = 0x616B3438
VERSION_AWQ = 5
VERSION_FP16 = 6
HEADER_BYTES = 256
EXT_OFFSET = 0x40
EXT_TAG = b"orx1"
MAX_EOS = 8
_BASE = struct.Struct("<Ii7iBii")                 # magic .. group_size: 45 bytes, no alignment
_EXT = struct.Struct(f"<4sddii{MAX_EOS}i")        # the orinfer extension at EXT_OFFSET
# Region B order: (the seed's name, the HF module path)
_LINEARS = (("wq", "self_attn.q_proj"), ("wk", "self_attn.k_proj"), ("wv", "self_attn.v_proj"),
            ("wo", "self_attn.o_proj"), ("w1", "mlp.gate_proj"), ("w2", "mlp.down_proj"), ("w3", "mlp.up_proj"))


def _linear_shape(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of a decoder linear."""
    h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {"self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
            "self_attn.o_proj": (q, h), "mlp.gate_proj": (h, i), "mlp.up_proj": (h, i),
            "mlp.down_proj": (i, h)}[module]


def layout(cfg: ModelConfig) -> Iterator[tuple[str, tuple[int, ...], torch.dtype]]:
    """(HF tensor name, shape, dtype) of every tensor in file order; AWQ when cfg.quantization is set."""
    n, h, v = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    f16, i32 = torch.float16, torch.int32
    for i in range(n):
        yield f"model.layers.{i}.input_layernorm.weight", (h,), f16
    for i in range(n):
        yield f"model.layers.{i}.post_attention_layernorm.weight", (h,), f16
    yield "model.norm.weight", (h,), f16
    yield "model.embed_tokens.weight", (v, h), f16
    for _, module in _LINEARS:
        fin, fout = _linear_shape(cfg, module)
        for i in range(n):
            base = f"model.layers.{i}.{module}"
            if cfg.quantization is not None:
                groups = fin // cfg.quantization.group_for(fin)
                yield base + ".qweight", (fin, fout // 8), i32
                yield base + ".qzeros", (groups, fout // 8), i32
                yield base + ".scales", (groups, fout), f16
            else:
                yield base + ".weight", (fout, fin), f16
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", (v, h), f16
    for i in range(n):
        yield f"model.layers.{i}.self_attn.q_norm.weight", (cfg.head_dim,), f16
    for i in range(n):
        yield f"model.layers.{i}.self_attn.k_norm.weight", (cfg.head_dim,), f16


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    count = 1
    for d in shape:
        count *= d
    return count * torch.empty((), dtype=dtype).element_size()


def _check_exportable(cfg: ModelConfig, source: str) -> None:
    if cfg.architecture != "Qwen3ForCausalLM" or not cfg.qk_norm or cfg.attention_bias:
        raise ConfigError(f"{source}: the seed .bin layout holds Qwen3 decoders only (q/k norms, no q/k/v bias); "
                          f"got {cfg.architecture}")
    if cfg.quantization is not None and cfg.quantization.method != "awq":
        raise ConfigError(f"{source}: the seed .bin layout holds AWQ INT4 or 16-bit weights, not "
                          f"{cfg.quantization.method.upper()}")


def encode_header(cfg: ModelConfig) -> bytes:
    """The 256-byte header for `cfg` (version 5 when quantized, else 6), with orinfer's extension."""
    version = VERSION_AWQ if cfg.quantization is not None else VERSION_FP16
    group = cfg.quantization.group_size if cfg.quantization is not None else 0
    buf = bytearray(HEADER_BYTES)
    _BASE.pack_into(buf, 0, MAGIC, version, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers,
                    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size, cfg.max_position_embeddings,
                    int(cfg.tie_word_embeddings), cfg.head_dim, group)
    eos = list(cfg.eos_token_id)[:MAX_EOS]
    _EXT.pack_into(buf, EXT_OFFSET, EXT_TAG, float(cfg.rope_theta), float(cfg.rms_norm_eps),
                   -1 if cfg.bos_token_id is None else int(cfg.bos_token_id), len(eos),
                   *(eos + [0] * (MAX_EOS - len(eos))))
    return bytes(buf)


def decode_header(data: bytes, source: str = "model.bin") -> ModelConfig:
    """ModelConfig from a .bin header; files without orinfer's extension get rope_theta 1e6 and eps 1e-6."""
    if len(data) < HEADER_BYTES:
        raise WeightsError(f"{source}: file too short for the 256-byte header ({len(data)} bytes)")
    magic, version, dim, hidden, layers, heads, kv_heads, vocab, max_len, shared, head_dim, group = \
        _BASE.unpack_from(data, 0)
    if magic != MAGIC:
        raise WeightsError(f"{source}: bad magic 0x{magic:08x}, expected 0x{MAGIC:08x} (\"ak48\")")
    if version not in (VERSION_AWQ, VERSION_FP16):
        raise WeightsError(f"{source}: unsupported .bin version {version} (5: AWQ INT4, 6: FP16)")
    dims = dict(dim=dim, hidden_dim=hidden, n_layers=layers, n_heads=heads, n_kv_heads=kv_heads,
                vocab_size=abs(vocab), max_seq_len=max_len, head_dim=head_dim)
    bad = [f"{k}={v}" for k, v in dims.items() if v <= 0]
    if bad or heads % kv_heads:
        raise WeightsError(f"{source}: invalid header ({', '.join(bad) or f'n_heads={heads}, n_kv_heads={kv_heads}'})")
    rope_theta, eps, bos, eos = 1_000_000.0, 1e-6, None, []
    tag, theta, eps_ext, bos_ext, n_eos, *eos_ids = _EXT.unpack_from(data, EXT_OFFSET)
    if tag == EXT_TAG:
        rope_theta, eps = theta, eps_ext
        bos = None if bos_ext < 0 else bos_ext
        eos = list(eos_ids[: max(0, min(n_eos, MAX_EOS))])
    quant = None
    if version == VERSION_AWQ:
        if group <= 0 and group != -1:
            raise WeightsError(f"{source}: AWQ file with invalid group_size {group}")
        quant = QuantConfig(group_size=group)
    cfg = ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=abs(vocab), hidden_size=dim,
                      intermediate_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=max_len,
                      rope_theta=rope_theta, rms_norm_eps=eps, tie_word_embeddings=bool(shared), attention_bias=False,
                      qk_norm=True, torch_dtype="float16", bos_token_id=bos, eos_token_id=eos, quantization=quant)
    if quant is not None:
        try:
            quant.check_model(cfg, source)
        except ConfigError as exc:
            raise WeightsError(str(exc)) from None
    return cfg


def is_seed_bin(path: str | Path) -> bool:
    """True for a regular file that starts with the "ak48" magic."""
    p = Path(path)
    if not p.is_file():
        return False
    with p.open("rb") as f:
        head = f.read(4)
    return len(head) == 4 and struct.unpack("<I", head)[0] == MAGIC


def read_bin_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a .bin file (reads the header only)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"model file not found: {path}")
    with p.open("rb") as f:
        return decode_header(f.read(HEADER_BYTES), str(p))


def export_bin(in_dir: str | Path, out_path: str | Path) -> dict:
    """Writes the Qwen3 model in `in_dir` (AWQ -> version 5, otherwise the FP16 variant, version 6) to `out_path`.
    Tensors are read one at a time from the (mmapped) safetensors files; 16-bit floats are stored as fp16."""
    in_dir, out_path = Path(in_dir), Path(out_path)
    cfg = ModelConfig.from_hf(in_dir)
    _check_exportable(cfg, str(in_dir))
    files = checkpoint_files(in_dir)
    handles = [safe_open(str(f), framework="pt") for f in files]
    where = {name: h for h in handles for name in h.keys()}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with out_path.open("wb") as out:
        out.write(encode_header(cfg))
        written += HEADER_BYTES
        for name, shape, dtype in layout(cfg):
            source = name
            if name == "lm_head.weight" and name not in where:
                source = "model.embed_tokens.weight"
            if source not in where:
                raise WeightsError(f"{in_dir}: checkpoint is missing {name}")
            tensor = where[source].get_tensor(source)
            if tuple(tensor.shape) != shape:
                raise WeightsError(f"{name}: expected shape {shape}, checkpoint has {tuple(tensor.shape)}")
            if dtype == torch.int32:
                if tensor.dtype != torch.int32:
                    raise WeightsError(f"{name}: expected int32, checkpoint has {tensor.dtype}")
            else:
                tensor = tensor.to(torch.float16)
                if not torch.isfinite(tensor).all():
                    raise WeightsError(f"{name}: values outside fp16's range")
            data = tensor.contiguous().numpy().tobytes()
            out.write(data)
            written += len(data)
    return {"path": str(out_path), "version": VERSION_AWQ if cfg.quantization is not None else VERSION_FP16,
            "bytes": written, "config": cfg}


def iter_bin_tensors(path: str | Path, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) views into the mmapped file, in file order; checks the file size first."""
    p = Path(path)
    expected = HEADER_BYTES + sum(_nbytes(shape, dtype) for _, shape, dtype in layout(cfg))
    size = p.stat().st_size
    if size != expected:
        raise WeightsError(f"{p}: file has {size} bytes, the header's shapes need {expected} "
                           f"({'truncated' if size < expected else 'trailing data'})")
    with p.open("rb") as f:
        # Copy-on-write private mapping (the seed's MAP_PRIVATE): pages are read lazily, tensors are writable views.
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    offset = HEADER_BYTES
    for name, shape, dtype in layout(cfg):
        count = _nbytes(shape, dtype) // torch.empty((), dtype=dtype).element_size()
        yield name, torch.frombuffer(mm, dtype=dtype, count=count, offset=offset).view(shape)
        offset += _nbytes(shape, dtype)


def load_bin_model(path: str | Path, ops: Ops, weight_dtype: torch.dtype, act_dtype: torch.dtype,
                   device: torch.device) -> tuple[nn.Module, ModelConfig]:
    """Builds the model a .bin file describes and fills it from the mmapped file; returns (model, config)."""
    from orinfer.models.registry import build_model  # lazy: loader/__init__ imports models too

    cfg = read_bin_config(path)
    model = build_model(cfg, ops, weight_dtype, act_dtype, device)
    model.load_weights((name, t.to(device)) for name, t in iter_bin_tensors(path, cfg))
    from orinfer.loader import finish_loading
    finish_loading(model)
    return model, cfg

