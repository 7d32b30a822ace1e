"""Reading a run record (run.json) defensively: a malformed part must not sink the report."""

from __future__ import annotations

import json
import math
from pathlib import Path

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"
LATENCY_THRESHOLD = 0.10  # relative change of a latency/throughput figure treated as run-to-run noise (CPU runs vary)
MIN_ABS_MS = 2.0  # a latency change below this many ms is timer/scheduler jitter, whatever its ratio
STAGE_OK = "ok"


class CompareError(Exception):
    """Runs that cannot be compared (missing, unreadable, no last good run); the message says what to do."""


def _metrics(record: dict, step: str) -> dict:
    st = _d(_d(record.get("stages")).get(step))
    return _d(st.get("metrics")) if st.get("status") == STAGE_OK else {}


def _d(x) -> dict:
    """x if it is a dict, else {} (several stages write the record)."""
    return x if isinstance(x, dict) else {}


def _l(x) -> list:
    return x if isinstance(x, list) else []


def _s(x) -> str | None:
    """A label (variant, workload, task, metric) as a string, so a malformed one cannot break grouping."""
    return None if x is None else x if isinstance(x, str) else json.dumps(x, sort_keys=True, default=str)


def _int(x) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def _num(v):
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _pct(d, key):
    return _num(_d(d).get(key)) if isinstance(d, dict) else None


def _pair(ci) -> list[float] | None:
    """A recorded [lo, hi] interval as floats; None for anything else."""
    return (
        [float(ci[0]), float(ci[1])]
        if isinstance(ci, (list, tuple)) and len(ci) == 2 and all(_num(x) is not None for x in ci)
        else None
    )


def artifact_names(record: dict) -> list[str]:
    names = [_s(a.get("name")) for a in _l(_d(record.get("recipe")).get("artifacts")) if isinstance(a, dict)]
    names += [n for n in _d(record.get("artifacts")) if n not in names]
    return list(dict.fromkeys(n for n in names if n))


def _workload(record: dict) -> dict:
    wl = _l(_d(_d(record.get("recipe")).get("benchmark")).get("workloads"))
    return wl[0] if wl and isinstance(wl[0], dict) else {}


def _serve_rows(bench: dict, workload: str | None) -> tuple[str | None, dict]:
    """(variant, {concurrency: result}) of the benchmark's best variant (else the first measured) on `workload`."""
    results = [r for r in _l(bench.get("results")) if isinstance(r, dict)]
    if not results:
        return None, {}
    variants = list(dict.fromkeys(_s(r.get("variant")) for r in results))
    best = _s(_d(bench.get("best")).get("variant"))
    variant = best if best in variants else variants[0]
    workloads = list(dict.fromkeys(_s(r.get("workload")) for r in results if _s(r.get("variant")) == variant))
    wl = workload if workload in workloads else workloads[0]
    rows = {
        _int(r.get("concurrency")): r
        for r in results
        if _s(r.get("variant")) == variant and _s(r.get("workload")) == wl
    }
    rows.pop(None, None)
    return variant, rows


def accuracy_rows(ev: dict) -> list[dict]:
    out = []
    for c in _l(ev.get("comparison")):
        if isinstance(c, dict):
            out.append(
                {
                    "task": _s(c.get("task")),
                    "metric": _s(c.get("metric")),
                    "value": _num(c.get("artifact")),
                    "baseline": _num(c.get("baseline")),
                    "recovery": _num(c.get("recovery")),
                    "ci95": _ci(c),
                    "n": c.get("n"),
                    "flip_rate": _num(c.get("flip_rate")),
                }
            )
    return out


def _ci(c: dict):
    ci = c.get("ci95")
    if isinstance(ci, (list, tuple)) and len(ci) == 2 and all(_num(x) is not None for x in ci):
        return [float(ci[0]), float(ci[1])]
    return None


def _recovery_halfwidth(c: dict) -> float | None:
    """Half-width of the 95% CI in recovery units: the CI is on the recovery if it brackets it, else on the score."""
    ci, rec, base = c.get("ci95"), c.get("recovery"), c.get("baseline")
    if ci is None:
        n, p = c.get("n"), c.get("value")
        if isinstance(n, int) and n > 0 and p is not None and 0 <= p <= 1 and base:
            return (
                1.96 * math.sqrt(max(p * (1 - p), 1 / n) / n) / base
            )  # binomial, floored so a perfect score still has width
        return None
    hw = (ci[1] - ci[0]) / 2
    if rec is not None and ci[0] - 1e-9 <= rec <= ci[1] + 1e-9:
        return hw
    return hw / base if base else None
