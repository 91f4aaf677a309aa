"""The same workload through HF transformers (random weights of the same shapes), in the same process."""

from __future__ import annotations

import statistics
import time

import torch

from orinfer.config import ModelConfig


def _hf_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, attn: str):
    import transformers

    hf_cfg = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.to_hf_dict().items() if k != "architectures"})
    hf_cfg.architectures = [cfg.architecture]
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype, attn_implementation=attn)
    return model.eval()


@torch.inference_mode()
def bench_hf(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, prompt_lens: list[int],
             decode_tokens: int, decode_prompt_len: int = 128, attn: str = "sdpa", repeats: int = 3) -> dict:
    import transformers

    model = _hf_model(cfg, dtype, device, attn)
    out: dict = {"version": transformers.__version__, "attn_implementation": attn, "prefill": {}, "decode": {}}
    gen = torch.Generator().manual_seed(0)

    def timed(fn) -> float:
        torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        return time.perf_counter() - t

    for length in prompt_lens:
        ids = torch.randint(100, cfg.vocab_size - 100, (1, length), generator=gen).to(device)
        timed(lambda: model(ids, logits_to_keep=1))
        seconds = statistics.median(timed(lambda: model(ids, logits_to_keep=1)) for _ in range(repeats))
        out["prefill"][length] = {"tok_s": length / seconds, "seconds": seconds}
    ids = torch.randint(100, cfg.vocab_size - 100, (1, decode_prompt_len), generator=gen).to(device)
    kwargs = dict(do_sample=False, max_new_tokens=decode_tokens, min_new_tokens=decode_tokens, pad_token_id=0)
    model.generate(ids, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
    prefill = timed(lambda: model(ids, logits_to_keep=1))
    total = timed(lambda: model.generate(ids, **kwargs))
    out["decode"][1] = {"tok_s": (decode_tokens - 1) / (total - prefill)}
    out["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    del model
    torch.cuda.empty_cache()
    return out
