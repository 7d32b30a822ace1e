"""What vLLM can serve on this machine, and the engine arguments quantpipe gives it, so that the benchmark stage, the
evaluate stage's vllm backend and the package stage's serve command decide servability and engine flags the same way.
Only `probe_platform` imports vLLM (serve environment); everything else is light."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING

from ..recipe import Engine
from ..stages import StageError

if TYPE_CHECKING:
    from ..recipe import Recipe
    from ..stages.contract import BenchmarkInput, PackageInput

DEFAULT_CPU_KV_BYTES = 256 * 2**20  # vLLM's CPU worker needs an explicit KV-cache size: quantpipe's minimum
# A GPU server's memory beyond its weights and KV cache (CUDA context, CUDA graphs, the profiling run's activations, the
# sampler's warm-up over max_num_seqs rows of logits), until a start on this host has been measured: servers of an 8B
# model on an H100 peaked 4.6-7.6 GiB above their weights and KV cache with vLLM's defaults.
GPU_OVERHEAD_BYTES = 10 * 2**30
KV_HEADROOM = 1.25  # the KV cache quantpipe picks holds a quarter more than the workloads' sequences at once
GPU_BYTES_ENV = "QUANTPIPE_GPU_BYTES"  # the GPU memory the scheduler granted a stage's server, for its start-up check
# vLLM names the linear kernel it picked as it loads a model: "Selected CutlassFP8ScaledMMLinearKernel for CompressedTensorsW8A8Fp8"
LINEAR_KERNEL = re.compile(r"\b(?:Selected|Using) (\w*Kernel\w*) for ([\w.-]+(?: linear)?)")


def probe_platform() -> dict:
    """The platform vLLM runs on here and the kernels it loaded (imports vLLM: serve env only)."""
    import torch
    from vllm.platforms import current_platform

    plat = {"platform": current_platform.device_type, "device": current_platform.device_name, "kernels": {}}
    if current_platform.is_cpu():
        current_platform.import_kernels()
        plat["kernels"]["cpu_gemm_wna16"] = hasattr(torch.ops._C, "cpu_gemm_wna16")
        plat["isa"] = torch.backends.cpu.get_cpu_capability()
    elif torch.cuda.is_available():
        plat["device"] = torch.cuda.get_device_name(0)
        plat["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        plat["gpu_total_bytes"] = torch.cuda.get_device_properties(0).total_memory
    return plat


def quant_scheme(model_dir: Path) -> dict | None:
    """Weight/activation precision of a checkpoint, from its config.json (None: not quantized)."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    qc = cfg.get("quantization_config") or cfg.get("compression_config")
    if not isinstance(qc, dict):
        return None
    qm = qc.get("quant_method") or qc.get("quant_type")
    if qm == "compressed-tensors":
        for g in (qc.get("config_groups") or {}).values():
            w = (g or {}).get("weights") or {}
            a = (g or {}).get("input_activations")
            if w:
                return {
                    "quant_method": qm,
                    "format": qc.get("format"),
                    "weight_bits": w.get("num_bits"),
                    "weight_type": w.get("type", "int"),
                    "activations": a is not None,
                    "group_size": w.get("group_size"),
                }
        return {
            "quant_method": qm,
            "format": qc.get("format"),
            "weight_bits": None,
            "weight_type": None,
            "activations": False,
        }
    if qm in ("gptq", "awq"):
        return {
            "quant_method": qm,
            "format": qm,
            "weight_bits": qc.get("bits") or qc.get("w_bit"),
            "weight_type": "int",
            "activations": False,
            "group_size": qc.get("group_size") or qc.get("q_group_size"),
        }
    return {
        "quant_method": qm,
        "format": qc.get("format"),
        "weight_bits": None,
        "weight_type": None,
        "activations": None,
    }


def unservable_reason(scheme: dict | None, method: str, plat: dict) -> str | None:
    """Why vLLM cannot serve this scheme on this platform (None: try it). Decided before any server starts."""
    if not scheme or plat.get("platform") != "cpu" or scheme.get("activations") is not False:
        return None
    bits, wtype = scheme.get("weight_bits"), scheme.get("weight_type")
    label = f"W{bits}A16" if bits else "weight-only"
    if wtype == "int" and bits == 4:
        if not plat.get("kernels", {}).get("cpu_gemm_wna16", False):
            return (
                f"{label} ({method}) needs vLLM's cpu_gemm_wna16 kernel, which vLLM's CPU build for this "
                f"machine ({plat.get('isa') or 'no AVX-512'}) lacks; serve it on a GPU or an AVX-512 CPU, "
                "or validate it through transformers"
            )
        return None
    if wtype == "int" and bits is not None:
        return (
            f"{label} ({method}): vLLM's CPU backend has no kernel for {bits}-bit weight-only layers "
            "(CPUWNA16 takes 4-bit weights only); serve it on a GPU, or use w8a8-int8 for CPU"
        )
    if wtype == "float":
        return f"{label} FP8 weight-only ({method}): vLLM's CPU backend has no FP8 weight-only kernel; use fp8 dynamic (W8A8)"
    return None


def variant_engines(inp: BenchmarkInput | PackageInput | Recipe) -> list[tuple[str, Engine]]:
    """("default", inp.benchmark.engine), then each variant: that engine updated with the variant's set fields."""
    base = inp.benchmark.engine
    out = [("default", base)]
    for v in inp.benchmark.variants:
        fields = v.engine.model_dump(exclude_unset=True)
        merged = base.model_dump()
        for k, val in fields.items():
            if k == "extra_args":
                merged[k] = list(base.extra_args) + list(val)  # as package.serve_command composes them
            elif val is not None:
                merged[k] = val
        out.append((v.name, Engine.model_validate(merged)))
    names = [n for n, _ in out]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise StageError(
            f"benchmark.variants: names must be unique and not 'default'; repeated: {', '.join(sorted(dup))}"
        )
    return out


def engine_flags(engine: dict) -> list[str]:
    """vLLM engine CLI flags (shared by `vllm serve` and `vllm bench latency|throughput`)."""
    args: list[str] = []
    for k, val in engine.items():
        if k == "extra_args" or val is None:
            continue
        flag = "--" + k.replace("_", "-")
        if isinstance(val, bool):
            args.append(flag if val else "--no-" + k.replace("_", "-"))
        else:
            args += [flag, str(val)]
    return args + list(engine.get("extra_args") or [])


def cpu_kv_bytes(
    engine_max_len: int | None,
    model_max_len: int | None,
    bytes_per_token: int | None,
    need_len: int,
    concurrency: int,
    available_bytes: int | None,
) -> tuple[int, int | None]:
    """The KV cache vLLM's CPU worker gets where the recipe sets none, and the max_model_len quantpipe sets to make it
    fit (None: left as it is). The cache holds the larger of one max_model_len sequence and the longest workload
    (`need_len` tokens) at the highest concurrency, with a tenth more, and at least DEFAULT_CPU_KV_BYTES; within a
    quarter of the free memory, shortening max_model_len to the workloads' need (rounded up to 256) where the recipe
    does not set it. Rounded up to whole MiB."""
    max_len = engine_max_len or model_max_len or need_len
    want = DEFAULT_CPU_KV_BYTES
    if bytes_per_token:
        want = max(want, int(bytes_per_token * max(max_len, need_len * concurrency) * 1.1))
    shortened = None
    cap = available_bytes // 4 if available_bytes else None
    if cap is not None and want > cap and bytes_per_token:
        if engine_max_len is None and max_len > need_len:
            shortened = int(math.ceil(need_len / 256) * 256)
            want = max(DEFAULT_CPU_KV_BYTES, int(bytes_per_token * max(shortened, need_len * concurrency) * 1.1))
        want = min(want, cap)
    return int(math.ceil(want / 2**20) * 2**20), shortened


def gpu_kv_bytes(bench, engine: Engine, bytes_per_token: int, model_max_len: int | None) -> int | None:
    """The KV cache of a GPU server whose engine sets neither kv_cache_memory_bytes nor gpu_memory_utilization: every
    sequence of the highest concurrency (or goodput-search bound) at the longest length a workload sends, with
    KV_HEADROOM, and never less than one max_model_len sequence; None where the engine sets either."""
    if engine.kv_cache_memory_bytes is not None or engine.gpu_memory_utilization is not None:
        return None
    max_len = engine.max_model_len or model_max_len or 2048
    longest = max((w.max_tokens or max_len) for w in bench.workloads)
    sequences = max([*bench.concurrency, bench.goodput_search or 0])
    tokens = max(max_len, longest * sequences) * KV_HEADROOM
    return math.ceil(tokens * bytes_per_token / 2**20) * 2**20


def gpu_utilization(need_bytes: int, total_bytes: int) -> float:
    """The gpu_memory_utilization that lets a server of `need_bytes` start on a card of `total_bytes`: vLLM refuses to
    start where less than that share of the card is free, and with kv_cache_memory_bytes set it reserves no more."""
    return min(0.98, math.ceil(100 * need_bytes / total_bytes) / 100)


def gpu_start_share(engine: dict, weights_bytes: int, plat: dict) -> float | None:
    """The gpu_memory_utilization a GPU server with a fixed KV cache gets where its engine sets none: the memory the
    scheduler granted it ($QUANTPIPE_GPU_BYTES), else weights + KV cache + GPU_OVERHEAD_BYTES, over the card's."""
    import os

    total = plat.get("gpu_total_bytes")
    if plat.get("platform") != "cuda" or not total or not engine.get("kv_cache_memory_bytes"):
        return None
    granted = os.environ.get(GPU_BYTES_ENV, "")
    need = int(granted) if granted.isdigit() else weights_bytes + engine["kv_cache_memory_bytes"] + GPU_OVERHEAD_BYTES
    return gpu_utilization(need, total)


def eval_kv_bytes(bytes_per_token: int, max_len: int | None) -> int:
    """The KV cache of an evaluation's own GPU server: one sequence of the model's full length with KV_HEADROOM."""
    return max(DEFAULT_CPU_KV_BYTES, math.ceil(bytes_per_token * (max_len or 2048) * KV_HEADROOM / 2**20) * 2**20)
