"""The engine arguments each benchmark server gets, and the LoRA set-up of the baseline's comparison. The recipe's engine
arguments go to vLLM as given, plus the model's dtype, trust_remote_code when the recipe asks for it and, on CPU, the
KV-cache size vLLM's CPU worker needs (the longest workload at the highest concurrency, within a quarter of the free
memory).

    engine, notes = effective_engine(inp.benchmark.engine, inp, model_dir, probe_platform(), need_len=96)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ...common.safetensors import weights_bytes
from ...common.shape import ModelShape
from ...common.vllm_support import KV_HEADROOM, cpu_kv_bytes, gpu_kv_bytes, gpu_start_share
from ...recipe import Adapter, Engine
from .. import StageError
from ..contract import BenchmarkInput

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts


def effective_engine(
    engine: Engine, inp: BenchmarkInput, model_dir: Path, plat: dict, need_len: int
) -> tuple[dict, list[str]]:
    """The engine arguments a server gets (the recipe's, plus those named above), and notes on what was set."""
    e = {k: v for k, v in engine.model_dump().items() if v is not None and v != []}
    notes = []
    e = {"dtype": inp.base.dtype, **e}
    if inp.base.trust_remote_code:
        e["trust_remote_code"] = True
    if plat.get("platform") == "cuda":
        notes += _gpu_memory(e, engine, inp, model_dir, plat)
    if (
        plat.get("platform") == "cpu"
        and "kv_cache_memory_bytes" not in e
        and "VLLM_CPU_KVCACHE_SPACE" not in os.environ
    ):
        shape = ModelShape.read(model_dir)
        bpt = shape.kv_bytes_per_token(e.get("kv_cache_dtype")) if shape else None
        model_max_len = shape.max_len if shape else None
        want, shortened = cpu_kv_bytes(
            e.get("max_model_len"), model_max_len, bpt, need_len, max(inp.benchmark.concurrency), _available_bytes()
        )
        if shortened:
            e["max_model_len"] = shortened
            notes.append(
                f"max_model_len set to {shortened} (the longest workload needs {need_len} tokens): "
                f"the model's {model_max_len or need_len} would not fit a CPU KV cache within a quarter of the free memory"
            )
        e["kv_cache_memory_bytes"] = want
        notes.append(
            f"kv_cache_memory_bytes set to {want} ({want / 2**30:.2f} GiB): vLLM's CPU backend needs an explicit "
            "KV-cache size and the recipe sets none (benchmark.engine.kv_cache_memory_bytes)"
        )
    return e, notes


def _gpu_memory(e: dict, engine: Engine, inp: BenchmarkInput, model_dir: Path, plat: dict) -> list[str]:
    """On a GPU: where the recipe sets neither kv_cache_memory_bytes nor gpu_memory_utilization, a KV cache sized from
    the workloads (common/vllm_support.gpu_kv_bytes), so the server needs what its traffic needs rather than 90 % of the
    card; and where the KV cache is fixed, the share of the card vLLM checks is free at start-up. Updates `e`."""
    notes = []
    shape = ModelShape.read(model_dir)
    bpt = shape.kv_bytes_per_token(e.get("kv_cache_dtype")) if shape else None
    kv = gpu_kv_bytes(inp.benchmark, engine, bpt, shape.max_len) if bpt else None
    if kv:
        e["kv_cache_memory_bytes"] = kv
        notes.append(
            f"kv_cache_memory_bytes set to {kv} ({kv / 2**30:.2f} GiB): the workloads' longest sequences at the highest "
            f"concurrency with {KV_HEADROOM:g}x headroom, as the recipe sets no KV-cache size "
            "(benchmark.engine.kv_cache_memory_bytes or gpu_memory_utilization)"
        )
    share = None if "gpu_memory_utilization" in e else gpu_start_share(e, weights_bytes(model_dir), plat)
    if share:
        e["gpu_memory_utilization"] = share
        notes.append(
            f"gpu_memory_utilization set to {share:g}: with a fixed KV cache it only decides how much of the card "
            "vLLM checks is free at start-up, so it is the memory this server was granted"
        )
    return notes


def _available_bytes() -> int:
    try:
        import psutil

        return psutil.virtual_memory().available
    except Exception:
        return 8 * 2**30


def lora_setup(adapters: list[Adapter]) -> tuple[list[str], list[str], list[str]]:
    """(server flags, adapter names, notes) for serving the base with these adapters attached at request time."""
    names, mods, ranks, notes = [], [], [], []
    for i, a in enumerate(adapters):
        try:
            cfg = json.loads((Path(a.path) / "adapter_config.json").read_text())
        except (OSError, ValueError) as e:
            raise StageError(
                f"adapters.{i}.path: cannot read adapter_config.json ({e}); check the adapter directory"
            ) from None
        name = f"adapter{i}"
        names.append(name)
        mods.append(f"{name}={a.path}")
        ranks.append(int(cfg.get("r") or 16))
        if a.weight != 1.0:
            notes.append(
                f"{name}: weight {a.weight:g} is applied when merging but not at request time (vLLM serves the adapter as trained)"
            )
    if len(names) > 1:
        notes.append(
            f"vLLM applies one adapter per request: the {len(names)} adapters take turns (round-robin), while the merged model holds all of them"
        )
    rank = next((r for r in LORA_RANKS if r >= max(ranks)), None)
    if rank is None:
        raise StageError(
            f"adapter rank {max(ranks)} exceeds vLLM's largest max_lora_rank ({LORA_RANKS[-1]}); set benchmark.lora: false"
        )
    flags = ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", str(len(names)), "--lora-modules", *mods]
    return flags, names, notes
