"""Timing-only patches for scripts/step_ab.py (session 21): each removes one piece of the batch-1 decode layer, so
the step replay shows what that piece costs on the critical path; the outputs are wrong and nothing else is
measured. Use: VARIANTS='nocomb=import upper_bounds as u; u.no_combine()|...' (scripts/ is on PYTHONPATH)."""

from __future__ import annotations


class _NoLaunch:
    """Stands in for a Triton kernel: `kernel[grid](...)` launches nothing."""

    def __getitem__(self, grid: object):
        return lambda *args, **kwargs: None


def no_combine() -> None:
    """Decode attention's split combine is not launched: o reads the output buffer as it is."""
    import orinfer.kernels.decode_attention as d
    d._combine_splits_kernel = _NoLaunch()


def no_rope() -> None:
    """No QK-norm + RoPE kernel (and so no KV store): attention reads q as the qkv GEMV wrote it."""
    import orinfer.layers.rotary as r
    r.RotaryEmbedding.forward = lambda self, positions, q, k, *args: (q, k)


def no_attention() -> None:
    """No attention kernels at all: o reads q."""
    import orinfer.kernels.decode_attention as d
    d.paged_decode_attention = lambda q, *args, **kwargs: q   # paged_attention looks it up in the module
