"""The dtype torch computes in, for a model stored in a given dtype, on this machine.

On a GPU, the model's own dtype. On a CPU, bfloat16 and float16 are fast only where oneDNN has kernels for
them (bfloat16: AVX-512; float16: AVX-512-FP16 or AMX); elsewhere torch falls back to scalar code, and
float32 is much faster (an AVX2 CPU: a bfloat16 matmul ~50x slower than float32, a 135M model's forward
pass ~6x). There the stages that compute with torch on the CPU (quantize's calibration, the hf evaluation)
load the model in float32; the quantize stage writes its artifact in the model's dtype all the same, and
both record the dtype they computed in.
"""

from __future__ import annotations

HALF = ("bfloat16", "float16")


def half_is_fast(dtype: str) -> bool:
    """True when this CPU has oneDNN kernels for `dtype` (bfloat16 or float16)."""
    import torch

    probe = {"bfloat16": "_is_mkldnn_bf16_supported", "float16": "_is_mkldnn_fp16_supported"}[dtype]
    try:
        return bool(getattr(torch.ops.mkldnn, probe)())
    except (AttributeError, RuntimeError):  # a torch without the probe: trust the dtype
        return True


def compute_dtype(dtype: str, device: str) -> str:
    """`dtype` (the model's), or float32 on a CPU where that half-precision dtype has no fast kernels."""
    if device == "cpu" and dtype in HALF and not half_is_fast(dtype):
        return "float32"
    return dtype
