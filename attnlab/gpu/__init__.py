"""attnlab.gpu: fused Triton kernels for DNAS, HNAS and Sinkhorn attention (docs/VARIANTS.md,
"GPU kernels (Triton)").

    attnlab.gpu.available(q) -> bool
    attnlab.gpu.fused_attend(q, k, v, variant, *, mask=None, scale=None, causal=False, u=None,
                             iters=None) -> Tensor (B, H, M, Dv) | None      (None: does not apply)
    attnlab.gpu.FAST_PATHS                 variant name -> kernel path (dnas, hnas, sinkhorn)

Importing this package imports torch only: triton is imported, and the kernels are compiled or
interpreted, on the first call that can use them (q on CUDA; or q on the CPU with TRITON_INTERPRET=1,
Triton's interpreter, which the tests use). attnlab works without triton installed.
"""

from attnlab.gpu.dispatch import FAST_PATHS, available, fused_attend

__all__ = ["FAST_PATHS", "available", "fused_attend"]
