"""Reading what a vLLM server writes, as plain text with no process attached: the root cause of a failure in its log
(`failure_reason`, which skips the exceptions that only wrap it) and its Prometheus `/metrics` page (`parse_metrics`).
`quantpipe.server.Server` uses both; the benchmark stage reads the logs of `vllm bench` runs with the first.
"""

from __future__ import annotations

import re

_LOG_PREFIX = re.compile(
    r"^(\(\w+ pid=\d+\)\s+)?((INFO|WARNING|ERROR|DEBUG|CRITICAL)\s+\d\d-\d\d \d\d:\d\d:\d\d\s+\[[^\]]*\]\s?)?"
)
_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt)): (.+)$")
# Exceptions that only wrap the real cause reported earlier in the log.
_WRAPPERS = (
    "initialization failed",
    "See root cause above",
    "See stack trace for root cause",
    "Engine core initialization failed",
)


def failure_reason(log_text: str) -> str:
    """The most specific error in a vLLM log: its first exception that is not a mere wrapper."""
    lines = [_LOG_PREFIX.sub("", ln).rstrip() for ln in log_text.splitlines()]
    found = []
    for i, ln in enumerate(lines):
        m = _EXC_LINE.match(ln.strip())
        if not m:
            continue
        msg = f"{m.group(1)}: {m.group(2)}"
        # vLLM lists the reasons of a failed kernel choice on the lines that follow.
        for nxt in lines[i + 1 : i + 8]:
            s = nxt.strip()
            if not s or s.startswith(("Traceback", "File ", "[", "^", "(")) or "[shutdown]" in s or _EXC_LINE.match(s):
                break
            msg += (" " if msg.endswith(":") else "; ") + s
        found.append(msg)
    specific = [f for f in found if not any(w in f for w in _WRAPPERS)]
    if specific:
        return specific[0][:800]
    if found:
        return found[-1][:800]
    tail = [ln for ln in lines if ln.strip()][-3:]
    return ("server exited; last log lines: " + " | ".join(tail))[:800] if tail else "server exited without any output"


# Causes that belong to the host at the moment a server ran, not to the model it served: a stage that meets one fails
# (and is tried again) instead of recording the model as not servable. Matched on vLLM's own words.
_FAULTS = (
    ("out of GPU memory", re.compile(r"out of memory|OutOfMemoryError|CUDA_ERROR_OUT_OF_MEMORY", re.I)),
    (
        "GPU memory taken by other processes",
        re.compile(r"Free memory on device .* is less than desired|less than desired GPU memory utilization", re.I),
    ),
    (
        "its KV cache does not fit",
        re.compile(r"No available memory for the cache blocks|larger than the available KV cache memory", re.I),
    ),
    ("the GPU is busy or unavailable", re.compile(r"busy or unavailable|cudaErrorDevicesUnavailable", re.I)),
    ("its port was taken", re.compile(r"address already in use", re.I)),
    ("its engine process died", re.compile(r"EngineDeadError|died unexpectedly|Engine core .* died", re.I)),
    ("a CUDA or NCCL error", re.compile(r"CUDA error|NCCL error|cudaError", re.I)),
    ("it was killed", re.compile(r"\bkilled by SIG|\bSIGKILL\b|\bKilled\b")),
    ("it did not become healthy in time", re.compile(r"not healthy after \d+ s")),
)


def fault_cause(reason: str, log_tail: str = "", started: bool = False) -> str | None:
    """Why a server's death is a fault of the host rather than a verdict on the model (None: a verdict, such as a kernel
    vLLM lacks for the scheme). A server that died after it was healthy always faulted: what the platform decides, it
    decides at load."""
    for what, pattern in _FAULTS:
        if pattern.search(reason) or (what == "out of GPU memory" and pattern.search(log_tail)):
            return what
    return "it died while serving" if started else None


def fault_recorded_as_verdict(benchmark_metrics: dict) -> str | None:
    """The fault a cached benchmark recorded as "not servable here" (a server that ran out of memory or was killed),
    which the platform's support table does not say: such an entry is measured again, never reused. None: a verdict."""
    m = benchmark_metrics or {}
    reasons = [m.get("reason")] + [v.get("reason") for v in (m.get("variants") or {}).values() if isinstance(v, dict)]
    for reason in reasons:
        if isinstance(reason, str) and reason.startswith("not servable here: "):
            fault = fault_cause(reason.removeprefix("not servable here: "))
            if fault:
                return fault
    return None


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name: value summed over labels}; `*_info` labels kept as `name{label}`."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            if s.name.endswith("_info") or fam.type == "info":
                for k, v in s.labels.items():
                    out[f"{s.name}{{{k}}}"] = v
                continue
            if s.name.endswith("_bucket"):
                continue
            out[s.name] = out.get(s.name, 0.0) + float(s.value)
    return out
