"""Pooling the points of several server starts (`benchmark.server_starts`). One server's requests give a point's 95%
intervals (stats.py), but a fresh server of the same engine can land outside them (docs/BENCHMARKS.md measures how
far). With several starts a point's figure is the median over the starts, its interval spans every start's interval,
counts add up, and `starts` keeps each start's own figures.

    pooled = pool_starts([rows_start1, rows_start2, rows_start3], bench.slo)
    search = pool_search(search, pooled, [rows_start2, rows_start3], bench.slo)
"""

from __future__ import annotations

import statistics

from .bench_serve import slo_met
from .stats import widest_half_width

SAME = ("variant", "workload", "kind", "concurrency", "ci_method", "raw", "pilot")  # the first start's
SUMMED = ("num_prompts", "completed", "failed", "ci_requests", "preemptions")
PER_START = ("request_throughput", "output_throughput", "goodput", "half_width")


def pool_starts(starts: list[list[dict]], slo) -> list[dict]:
    """The first start's points, each pooled with the same workload and concurrency of the other starts (a start that
    lacks the point is left out of it); every row gains `starts`, that point's figures per start."""
    pooled = []
    for row in starts[0]:
        same = [next((r for r in rows if _point(r) == _point(row)), None) for rows in starts]
        runs = [(k, r) for k, r in enumerate(same, start=1) if r is not None]
        out = {key: _pool(key, [r.get(key) for _, r in runs]) for key in row}
        out["slo_met"] = slo_met(out, slo)
        out["half_width"] = widest_half_width(out)
        out["starts"] = [
            {"start": k, **{f: r.get(f) for f in PER_START}, "ci95": r.get("ci95")} | _p50s(r) for k, r in runs
        ]
        pooled.append(out)
    return pooled


def pool_search(found: dict, pooled: list[dict], further: list[list[dict]], slo) -> dict:
    """The goodput search's answer (made on the first start) with the figures of every start at its concurrency: the
    pooled sweep row where the sweep has that point, else its probe pooled with the further starts' runs of it;
    `slo_met` says whether the pooled figures still meet the SLO there."""
    c, w = found.get("concurrency"), found.get("workload")
    if not c:
        return found
    at = next((r for r in pooled if r["workload"] == w and r["concurrency"] == c), None)
    rows = list(found.get("rows") or [])
    if at is None:
        i = next((i for i, r in enumerate(rows) if r["concurrency"] == c), None)
        if i is None:
            return found
        at = rows[i] = pool_starts([[rows[i]], *further], slo)[0]
    goodput_ci95 = (at.get("ci95") or {}).get("goodput")
    return found | {
        "goodput": at.get("goodput"),
        "goodput_ci95": goodput_ci95,
        "rows": rows,
        "slo_met": at.get("slo_met"),
    }


def _p50s(row: dict) -> dict:
    """A start's median latencies with their intervals, and its raw result."""
    out = {}
    for m in ("ttft", "tpot", "e2el"):
        lat = row.get(f"{m}_ms") or {}
        out |= {f"{m}_p50_ms": lat.get("p50"), f"{m}_p50_ci95_ms": lat.get("p50_ci95")}
    return out | {"raw": row.get("raw")}


def _point(row: dict) -> tuple:
    return row.get("workload"), row.get("concurrency")


def _pool(key: str, values: list):
    if key in SAME:
        return values[0]
    if all(isinstance(v, dict) for v in values):
        return {k: _pool(k, [v.get(k) for v in values]) for k in values[0]}
    if all(_interval(v) for v in values):
        return [min(v[0] for v in values), max(v[1] for v in values)]
    nums = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if not nums:
        return values[0]
    if key in SUMMED:
        return sum(nums)
    return statistics.median(nums)


def _interval(v) -> bool:
    return isinstance(v, list) and len(v) == 2 and all(isinstance(x, (int, float)) for x in v)
