"""Vision-tower op alternatives on Qwen3-VL-8B shapes for one 1024x768 image (3072 patches, D 1152, 16 heads of 72,
MLP 4304), timed with CUDA events and checked against an fp32 reference (device).
Usage: PYTHONPATH=. python3 scripts/vision_ops_ab.py

  attention: PyTorch SDPA per backend (flash, cuDNN, memory-efficient) on [1, 16, 3072, 72] bf16
  fc1 + bias + GELU-tanh: cuBLAS GEMM then our bias_gelu kernel, against the cuBLASLt GELU epilogue
  (torch._addmm_activation), and which GELU that epilogue computes (tanh or erf) in fp16/fp32
  attention layouts: q/k/v head-major [1, H, N, Dh] contiguous against token-major [N, H, Dh] viewed as BSHD, and
  the strides of the output in each case
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from orinfer.bench.ceilings import time_cuda
from orinfer.kernels.vision import bias_gelu


def main() -> None:
    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    n, heads, hd, d, inter = 3072, 16, 72, 1152, 4304
    q, k, v = (torch.randn(1, heads, n, hd, device=dev, dtype=dt) for _ in range(3))
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    flops = 4 * n * n * hd * heads
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            with sdpa_kernel([backend]):
                out = F.scaled_dot_product_attention(q, k, v)
                t = time_cuda(lambda: F.scaled_dot_product_attention(q, k, v), 5, 30)
            err = (out.float() - ref).abs().max().item()
            print(f"attention {name}: {t * 1e6:.1f} us, {flops / t / 1e12:.0f} TFLOP/s, max err {err:.2e}")
        except RuntimeError as exc:
            print(f"attention {name}: unavailable ({str(exc).splitlines()[0][:120]})")
    for layout in ("head-major", "token-major"):
        if layout == "head-major":
            qa, ka, va = q, k, v
        else:
            qa, ka, va = (t[0].transpose(0, 1).contiguous().unsqueeze(0).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(qa, ka, va)
        t = time_cuda(lambda: F.scaled_dot_product_attention(qa, ka, va), 5, 30)
        tt = time_cuda(lambda: F.scaled_dot_product_attention(qa, ka, va)[0].transpose(0, 1).contiguous(), 5, 30)
        print(f"attention default backend, {layout} inputs: {t * 1e6:.1f} us, output strides {out.stride()}, "
              f"with the [N, H, Dh] copy {tt * 1e6:.1f} us")
    for gdt in (torch.float16, torch.float32):
        a = torch.linspace(-4, 4, 256, device=dev, dtype=torch.float64)
        xs = torch.eye(256, device=dev, dtype=gdt)[:, :64].contiguous()  # x @ W^T picks W's columns
        wm = torch.zeros(256, 64, device=dev, dtype=gdt)
        bias = a.to(gdt)
        got = torch._addmm_activation(bias, xs, wm.t(), use_gelu=True).double()[0]
        pre = a.to(gdt).double()
        for name, refg in (("tanh", F.gelu(pre, approximate="tanh")), ("erf", F.gelu(pre))):
            print(f"_addmm_activation GELU {gdt}: max diff to the {name} GELU {(got - refg).abs().max().item():.2e}")
    x = torch.randn(n, d, device=dev, dtype=dt)
    w = torch.randn(inter, d, device=dev, dtype=dt) * d ** -0.5
    b = torch.randn(inter, device=dev, dtype=dt) * 0.1
    ref = F.gelu(F.linear(x.float(), w.float(), b.float()), approximate="tanh")
    ours = lambda: bias_gelu(F.linear(x, w), b, "tanh")  # noqa: E731
    lt = lambda: torch._addmm_activation(b, x, w.t(), use_gelu=True)  # noqa: E731
    gemm = lambda: F.linear(x, w)  # noqa: E731
    for name, fn in (("gemm only", gemm), ("gemm + bias_gelu", ours), ("cublasLt GELU epilogue", lt)):
        t = time_cuda(fn, 5, 30)
        err = (fn().float() - ref).abs().max().item() if name != "gemm only" else float("nan")
        print(f"fc1 {name}: {t * 1e6:.1f} us ({2 * n * d * inter / t / 1e12:.0f} TFLOP/s), max err {err:.2e}")


if __name__ == "__main__":
    main()
