"""The dtype torch computes in for a model stored in a given dtype: the model's own on a GPU. On a CPU, bfloat16 and
float16 are fast only where oneDNN has kernels for them; elsewhere torch falls back to scalar code (an AVX2 CPU: a
bfloat16 matmul ~50x slower than float32, a 135M model's forward pass ~6x). There quantize's calibration and the hf
evaluation load the model in float32 (quantize still writes its artifact in the model's dtype; both record the dtype
they computed in), and pre-flight sizes them by the same rule."""

from __future__ import annotations

from pathlib import Path

HALF = ("bfloat16", "float16")
# oneDNN's conditions on x86 (ideep has_bf16_type_support / has_fp16_type_support): AVX-512 "core" for
# bfloat16, AVX-512-FP16 for float16, or AVX2-VNNI-2's conversions (avx_ne_convert) for both
AVX512_CORE = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}


def cpu_flags() -> set[str] | None:
    """The x86 CPU's feature flags from /proc/cpuinfo; None elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return None


def half_is_fast(dtype: str) -> bool:
    """True when this CPU has oneDNN kernels for `dtype`; on x86 read from the CPU flags, so pre-flight needs no torch."""
    flags = cpu_flags()
    if flags is not None:
        if "avx_ne_convert" in flags:
            return True
        return AVX512_CORE <= flags and (dtype == "bfloat16" or "avx512_fp16" in flags)
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
