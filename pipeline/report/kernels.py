"""Which kernels vLLM served an artifact with, read from its server log, so a speed figure can be read against them.
vLLM names them as it loads the model ("Selected CutlassFP8ScaledMMLinearKernel for CompressedTensorsW8A8Fp8", "Using
FLASH_ATTN attention backend", weight-only FP8 through Marlin on a GPU without FP8 compute). The report reads the log
from the benchmark stage's cache entry (its metrics' `variants.<name>.log`, e.g. logs/server-default.log).

    parse_server_log(Path("logs/server-default.log").read_text())
    # {"linear": [{"kernel": "CutlassFP8ScaledMMLinearKernel", "family": "CUTLASS", "scheme": "CompressedTensorsW8A8Fp8"}], "attention": "FLASH_ATTN"}
"""

from __future__ import annotations

import re
from pathlib import Path

from ..common.lenient import label
from ..common.vllm_support import LINEAR_KERNEL as LINEAR
from ..run.record import StageRecord
from .records import BenchmarkFigures, Variant

ATTENTION = re.compile(r"\bUsing (\w+) attention backend|\bUsing (\w+) backend\.")
FP8_MARLIN = re.compile(r"Weight-only FP8 compression will be used leveraging the Marlin kernel")
# the kernel class's family, as vLLM's docs name them (longest prefix first)
FAMILIES = [
    ("MarlinFP8", "FP8 Marlin (weight-only)"),
    ("Machete", "Machete"),
    ("Marlin", "Marlin"),
    ("CutlassW4A8", "CUTLASS W4A8"),
    ("Cutlass", "CUTLASS"),
    ("FlashInfer", "FlashInfer"),
    ("DeepGemm", "DeepGEMM"),
    ("Triton", "Triton"),
    ("Exllama", "ExLlama"),
    ("Conch", "Conch"),
    ("Allspark", "AllSpark"),
    ("Aiter", "AITER"),
    ("Zentorch", "zentorch"),
    ("CPU", "vLLM CPU"),
    ("Torch", "torch._scaled_mm"),
    ("Dynamic4bit", "dynamic 4-bit (CPU)"),
]
CPU_ATTENTION = "CPU_ATTN"  # vllm/platforms/cpu.py returns it for every non-MLA model without logging a line


def family(kernel: str) -> str:
    for prefix, name in FAMILIES:
        if kernel.startswith(prefix):
            return name
    return kernel


def parse_server_log(text: str) -> dict:
    schemes: dict[
        str, list[str]
    ] = {}  # kernel -> what vLLM said it serves ("CompressedTensorsWNA16", "mixed-precision linear")
    for m in LINEAR.finditer(text):
        if not m.group(1).endswith("Config") and m.group(2) not in schemes.setdefault(m.group(1), []):
            schemes[m.group(1)].append(m.group(2))
    linear = [
        {"kernel": k, "family": family(k), "scheme": ", ".join([x for x in v if x != "mixed-precision linear"] or v)}
        for k, v in schemes.items()
    ]
    if FP8_MARLIN.search(text) and not any(x["family"].startswith("FP8 Marlin") for x in linear):
        linear.append(
            {
                "kernel": "MarlinFP8ScaledMMLinearKernel",
                "family": "FP8 Marlin (weight-only)",
                "scheme": "FP8 (no FP8 compute on this GPU)",
            }
        )
    att = [a or b for a, b in ATTENTION.findall(text)]
    return {"linear": linear, "attention": att[-1] if att else None}


def serving_info(stage: StageRecord, variant: str | None) -> dict | None:
    """What a benchmark stage's server ran the artifact with (its best variant's server log), or None if nothing was served."""
    m = BenchmarkFigures.model_validate(stage.metrics)
    if stage.status != "ok" or not stage.metrics or m.servable is False:
        return None
    info = m.variants.get(variant or "default") or m.variants.get("default") or Variant()
    out = {
        "platform": m.platform,
        "variant": variant or "default",
        "linear": [],
        "attention": None,
        "source": None,
        "note": None,
    }
    given = info.kernels or m.kernels  # a benchmark stage that records them itself
    if given:
        linear = given.get("linear")
        out |= {
            "linear": [x for x in linear if isinstance(x, dict)] if isinstance(linear, list) else [],
            "attention": label(given.get("attention")),
            "source": "benchmark metrics",
        }
    else:
        log_rel = info.log or "logs/server-default.log"
        try:
            text = (Path(stage.out) / log_rel).read_text(errors="replace") if stage.out else None
        except OSError:
            text = None
        if text is None:
            out["note"] = (
                "the server log is not at hand (the stage's cache entry is gone), so the kernels are not known"
            )
            return out
        out |= parse_server_log(text)
        out["source"] = f"server log {log_rel}"
    if not out["linear"]:
        out["note"] = "the server log names no linear kernel (vLLM names one for quantized layers only)"
    if out["attention"] is None and m.platform == "cpu":
        out["attention"] = CPU_ATTENTION
        out["attention_note"] = "vLLM's CPU platform uses it for non-MLA models without naming it in the log"
    return out
