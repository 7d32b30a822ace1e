"""The server's own figures around the runs, read without disturbing them: prefix-cache hits and queries and
preemptions from its Prometheus /metrics (read between runs; either name vLLM has given a counter), the peaks of KV-cache
usage and running/waiting requests from the stats lines its engine logs during a run, the KV cache's size (from
/metrics, else the log) and the weights' size on disk and as loaded. A figure the server did not give is None.

    before = counters(srv.metrics())                  # {"hits": 0.0, "queries": 0.0, "preemptions": 0.0}
    engine_stats(srv.log_text()[log_at:])             # {"kv_cache_usage_peak": 0.015, "running_peak": 4, ...}
    kv_tokens(srv.metrics(), srv.log_text())          # the tokens its KV cache holds (None if it says nothing)
"""

from __future__ import annotations

import re
from pathlib import Path

from ...common.safetensors import weights_bytes


def _metric(m: dict, *names: str) -> float | None:
    for n in names:
        if n in m:
            return m[n]
    return None


def counters(m: dict) -> dict:
    return {
        "hits": _metric(m, "vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total") or 0.0,
        "queries": _metric(m, "vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total") or 0.0,
        "preemptions": _metric(m, "vllm:num_preemptions_total") or 0.0,
    }


_STATS_LINE = re.compile(r"Running: (\d+) reqs, Waiting: (\d+) reqs, (?:GPU|CPU|XPU)? ?KV cache usage: ([\d.]+)%")


def engine_stats(log_segment: str) -> dict:
    """Peaks of the engine's periodic stats lines in a piece of the server log. Read from the log, not by polling /metrics
    during the run: rendering /metrics (~50 KB) runs on the API server's event loop, which streams the tokens being timed."""
    found = _STATS_LINE.findall(log_segment)
    if not found:
        return {"kv_cache_usage_peak": None, "running_peak": None, "waiting_peak": None}
    return {
        "kv_cache_usage_peak": max(float(u) for _, _, u in found) / 100,
        "running_peak": max(int(r) for r, _, _ in found),
        "waiting_peak": max(int(w) for _, w, _ in found),
    }


def kv_tokens(m: dict, log_text: str) -> int | None:
    for k in ("vllm:cache_config_info{kv_cache_size_tokens}",):
        v = m.get(k)
        if v not in (None, "None", ""):
            try:
                return int(float(v))
            except (TypeError, ValueError):
                pass
    try:
        blocks, size = int(m["vllm:cache_config_info{num_gpu_blocks}"]), int(m["vllm:cache_config_info{block_size}"])
        return blocks * size
    except (KeyError, TypeError, ValueError):
        pass
    found = re.findall(r"(?:GPU|CPU) KV cache size: ([\d,]+) tokens", log_text)
    return int(found[-1].replace(",", "")) if found else None


def kv_gib(m: dict) -> float | None:
    v = m.get("vllm:cache_config_info{kv_cache_memory_bytes}")
    try:
        return round(int(float(v)) / 2**30, 4)
    except (TypeError, ValueError):
        return None


def weights_gib(model_dir: Path) -> float:
    return round(weights_bytes(model_dir) / 2**30, 4)


def loaded_weights_gib(log_text: str) -> float | None:
    found = re.findall(r"Model loading took ([\d.]+) GiB", log_text)
    return float(found[-1]) if found else None
