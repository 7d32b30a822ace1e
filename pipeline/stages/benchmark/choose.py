"""Choosing from the measured rows: the (variant, concurrency) with the most goodput within the SLO, the highest
concurrency within it, and LoRA served at request time against the merged model."""

from __future__ import annotations

import math

from ...recipe import Benchmark


def pick_best(rows: list[dict], bench: Benchmark) -> dict:
    """The (variant, concurrency) that meets the SLO with the most goodput, on the benchmark's first workload."""
    wl = bench.workloads[0].name
    cands = [r for r in rows if r["workload"] == wl and r.get("completed")]
    s = bench.slo
    bounds = ", ".join(
        f"{k.removesuffix('_ms').replace('_', ' ')} ≤ {v:g} ms" for k, v in s.model_dump().items() if v is not None
    )
    if not cands:
        return {
            "variant": None,
            "concurrency": None,
            "goodput": None,
            "reason": f"nothing was measured on workload {wl!r}",
        }
    if not bounds:
        r = max(cands, key=lambda r: r["request_throughput"] or 0)
        return {
            "variant": r["variant"],
            "concurrency": r["concurrency"],
            "goodput": r["request_throughput"],
            "goodput_ci95": (r.get("ci95") or {}).get("request_throughput"),
            "reason": f"no SLO set: the most requests/s on workload {wl!r} ({r['request_throughput']:.3g} req/s)",
        }
    ok = [r for r in cands if r.get("slo_met")]
    if not ok:
        near = min(cands, key=lambda r: (r.get("ttft_ms") or {}).get("p99") or math.inf)
        return {
            "variant": None,
            "concurrency": None,
            "goodput": 0.0,
            "reason": f"no variant meets the SLO ({bounds}) on workload {wl!r} at any measured concurrency; lowest TTFT p99 "
            f"{(near.get('ttft_ms') or {}).get('p99') or float('nan'):.1f} ms ({near['variant']}, concurrency {near['concurrency']})",
        }
    r = max(ok, key=lambda r: (r.get("goodput") or 0, -r["concurrency"]))
    return {
        "variant": r["variant"],
        "concurrency": r["concurrency"],
        "goodput": r.get("goodput"),
        "goodput_ci95": (r.get("ci95") or {}).get("goodput"),
        "reason": f"meets the SLO ({bounds}) on workload {wl!r} with the most goodput: {r.get('goodput') or 0:.3g} req/s "
        f"at concurrency {r['concurrency']} ({len(ok)} of {len(cands)} variant x concurrency points meet it)",
    }


def highest_within_slo(
    probe, known: dict[int, bool], bound: int, resolution: float = 0.1
) -> tuple[int | None, list[int]]:
    """The highest concurrency in [1, bound] at which the SLO holds (taken to hold below any concurrency where it holds),
    by bisection with `probe(c) -> bool` between the highest pass and the lowest fail in `known` (concurrency -> SLO met)
    until they are within `resolution`. Returns (that concurrency, None when it fails even at 1; the concurrencies probed)."""
    lo = max((c for c, ok in known.items() if ok and c <= bound), default=0)
    hi = min((c for c, ok in known.items() if not ok and c > lo), default=bound + 1)
    probed = []
    while hi - lo > max(1, math.ceil(lo * resolution)):
        mid = bound if hi > bound else (lo + hi) // 2  # the bound itself first: when the SLO holds there, one probe
        probed.append(mid)
        if probe(mid):
            lo = mid
        else:
            hi = mid
    return (lo or None), probed


def compare_lora(lora_rows: list[dict], merged_rows: list[dict]) -> list[dict]:
    """Output throughput, TTFT p50 and TPOT p50 of LoRA served at request time over the merged model's, per workload x concurrency."""
    merged = {(r["workload"], r["concurrency"]): r for r in merged_rows}
    out = []
    for r in lora_rows:
        m = merged.get((r["workload"], r["concurrency"]))
        if not m:
            continue

        def ratio(a, b):
            return round(a / b, 4) if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None

        out.append(
            {
                "workload": r["workload"],
                "concurrency": r["concurrency"],
                "output_throughput_ratio": ratio(r["output_throughput"], m["output_throughput"]),
                "ttft_p50_ratio": ratio(r["ttft_ms"]["p50"], m["ttft_ms"]["p50"]),
                "tpot_p50_ratio": ratio(r["tpot_ms"]["p50"], m["tpot_ms"]["p50"]),
            }
        )
    return out
