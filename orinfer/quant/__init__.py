"""Weight quantization to AWQ INT4 (W4A16) checkpoints: round-to-nearest (`rtn`) and activation-aware (`awq`).

`quantize_checkpoint(in_dir, out_dir, method="awq")` reads a Hugging Face Qwen2/Qwen3 directory and writes an
AutoAWQ-format directory (config.json with quantization_config, model.safetensors with qweight/qzeros/scales for the
seven decoder linears per layer, 16-bit everything else, tokenizer files) that orinfer, HF transformers (with
autoawq) and vLLM load. `orinfer quantize IN_DIR OUT_DIR --method awq|rtn` is the command line.
"""

from orinfer.quant.checkpoint import quantize_checkpoint
from orinfer.quant.eval import perplexity

__all__ = ["quantize_checkpoint", "perplexity"]
