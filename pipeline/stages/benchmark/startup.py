"""A server's start-up, phase by phase, from the lines vLLM logs while it starts (as `vllm bench startup` splits it).
`compile_cache` is "hit" when vLLM loaded its compiled graphs from the cache (a warm start), "miss" when it compiled
them, None when nothing was compiled (enforce_eager). `warmup_s` runs from the end of CUDA-graph capture to the end of
the engine's initialisation: the kernels' warm-up, which in a host's first vLLM process also holds one-time kernel work
(kept in the host's caches for later starts). A phase vLLM did not log (no compile, no CUDA graphs) is None.

    startup_phases(log_text, start_s=41.2)  # {"ready_s": 41.2, "before_log_s": 9.8, "compile_s": 13.2, ...}
"""

from __future__ import annotations

import re
from datetime import datetime

_TIME = re.compile(r"\b(\d\d-\d\d \d\d:\d\d:\d\d)\b")
_PHASES = {
    "weights_s": (r"Model loading took [\d.]+ GiB and ([\d.]+) seconds", r"Loading weights took ([\d.]+) seconds"),
    "compile_s": (r"torch\.compile (?:took|takes) ([\d.]+) s in total",),
    "graph_capture_s": (r"Graph capturing finished in ([\d.]+) secs",),
    "engine_init_s": (r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s",),
}


def startup_phases(log_text: str, start_s: float | None = None) -> dict:
    """Seconds per start-up phase; `start_s` (spawn to healthy, as the server measured it) gives the time before
    vLLM's first log line (the interpreter and its imports)."""
    out: dict = {"ready_s": round(start_s, 2) if start_s is not None else None}
    for key, patterns in _PHASES.items():
        out[key] = next((float(m.group(1)) for p in patterns for m in [re.search(p, log_text)] if m), None)
    out["compile_cache"] = (
        "hit"
        if "Directly load the compiled graph" in log_text
        else "miss"
        if re.search(r"Compiling a graph for", log_text)
        else None
    )
    first, engine, ready = (
        _when(log_text, None),
        _when(log_text, "Initializing a V1 LLM engine"),
        _when(log_text, "Starting vLLM server on"),
    )
    out["before_engine_s"] = _span(first, engine)
    out["warmup_s"] = _span(_when(log_text, "Graph capturing finished"), _when(log_text, "init engine ("))
    span = _span(first, ready)
    out["before_log_s"] = round(max(0.0, start_s - span), 2) if start_s is not None and span is not None else None
    return out


def _when(log_text: str, marker: str | None) -> datetime | None:
    """The timestamp of the first log line (containing `marker`)."""
    for line in log_text.splitlines():
        if marker is None or marker in line:
            m = _TIME.search(line)
            if m:
                return datetime.strptime(m.group(1), "%m-%d %H:%M:%S")
    return None


def _span(a: datetime | None, b: datetime | None) -> float | None:
    return (b - a).total_seconds() if a and b and b >= a else None
