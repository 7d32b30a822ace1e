"""95% intervals for one sweep point: a percentile bootstrap over its completed requests (`vllm bench serve
--save-detailed`). Requests are resampled instead of runs repeated: a repeat costs as much as the run, while one run's
requests already sample what varies between requests (batch composition, scheduling, preemption). At a fixed
concurrency throughput follows from the latencies (Little's law: throughput = concurrency / mean latency), so each
resample also gives a throughput, scaled to the measured one. Drift between runs (the machine busier a minute later) is
not seen here; `compare` keeps its run-to-run threshold for that.

    intervals(raw, slo)  ->  {"n": 64, "ttft_ms": {"p50": [lo, hi], "p99": [lo, hi]}, ..., "ci95": {...}}
    prompts_for(0.03, 32, 0.06, 512)  ->  128     # a pilot of 32 at ±6 %: 4x the requests for ±3 %
"""

from __future__ import annotations

import math
import warnings

import numpy as np

RESAMPLES = 1000
SEED = 0
METRICS = ("ttft", "tpot", "e2el")
PERCENTILES = (50, 99)


def per_request(raw: dict) -> dict[str, np.ndarray]:
    """Per completed request, in ms as vLLM computes them: ttft, e2el (its latency), tpot ((e2el - ttft) / (output
    tokens - 1); NaN for a single output token, which vLLM leaves out of its TPOT figures), and output tokens."""
    ok = [i for i, e in enumerate(raw.get("errors") or []) if not e]
    ttft = np.array([raw["ttfts"][i] for i in ok], dtype=float) * 1000
    if raw.get("latencies"):
        e2el = np.array([raw["latencies"][i] for i in ok], dtype=float) * 1000
    else:
        e2el = ttft + np.array([sum(raw["itls"][i]) for i in ok], dtype=float) * 1000
    out = np.array([raw["output_lens"][i] for i in ok], dtype=float)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(out > 1, (e2el - ttft) / (out - 1), np.nan)
    return {"ttft": ttft, "tpot": tpot, "e2el": e2el, "out": out}


def _good(req: dict[str, np.ndarray], slo) -> np.ndarray:
    """Which requests meet the SLO's bounds (vLLM's --goodput test, request by request)."""
    good = np.ones(len(req["ttft"]), dtype=bool)
    for m, bound in (("ttft", slo.ttft_p99_ms), ("tpot", slo.tpot_p99_ms), ("e2el", slo.e2el_p99_ms)):
        if bound is not None:
            good &= np.nan_to_num(req[m]) <= bound  # a single-token request's TPOT counts as 0, as vLLM counts it
    return good


def intervals(raw: dict, slo=None, resamples: int = RESAMPLES, seed: int = SEED) -> dict | None:
    """The point's 95% intervals: p50/p99 of TTFT, TPOT and e2e latency, request and output throughput, and goodput
    (with an SLO); None when the result has no per-request data or fewer than two completed requests."""
    if not all(k in raw for k in ("ttfts", "itls", "output_lens", "errors")):
        return None
    req = per_request(raw)
    n = len(req["ttft"])
    if n < 2:
        return None
    idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    res: dict = {"n": n, "resamples": resamples, "method": "percentile bootstrap over requests"}
    for m in (m for m in METRICS if not np.isnan(req[m]).all()):
        with warnings.catch_warnings():  # a resample of single-token requests only has no TPOT: it is left out
            warnings.simplefilter("ignore", RuntimeWarning)
            draws = np.nanpercentile(req[m][idx], PERCENTILES, axis=1)
        res[f"{m}_ms"] = {f"p{p}": _ci(d) for p, d in zip(PERCENTILES, draws)}
    lat, out = req["e2el"], req["out"]
    mean_lat = lat[idx].mean(axis=1)
    req_rate = lat.mean() / mean_lat  # resampled throughput / measured throughput, by Little's law
    tok_rate = (out[idx].sum(axis=1) / lat[idx].sum(axis=1)) / (out.sum() / lat.sum())
    ci = {
        "request_throughput": _scaled(raw.get("request_throughput"), req_rate),
        "output_throughput": _scaled(raw.get("output_throughput"), tok_rate),
    }
    if slo is not None and raw.get("request_goodput") is not None:
        good = _good(req, slo)
        frac = good.mean()
        share = good[idx].mean(axis=1) / frac if frac > 0 else np.zeros(resamples)
        ci["goodput"] = _scaled(raw["request_goodput"], share * req_rate)
    res["ci95"] = {k: v for k, v in ci.items() if v is not None}
    return res


def widest_half_width(row: dict) -> float | None:
    """The widest relative half-width among median TPOT, median e2e latency and output throughput, which a comparison of
    artifacts rests on; TTFT is left out: under load its median is queueing time, which more requests barely narrow."""
    widths = [half_width(row[f"{m}_ms"].get("p50_ci95"), row[f"{m}_ms"].get("p50")) for m in ("tpot", "e2el")]
    widths.append(half_width((row.get("ci95") or {}).get("output_throughput"), row.get("output_throughput")))
    widths = [w for w in widths if w is not None]
    return round(max(widths), 4) if widths else None


def prompts_for(precision: float, n: int, width: float | None, cap: int) -> int:
    """Requests for a half-width of `precision`, from a pilot run of n whose half-width was `width` (which shrinks as
    1/sqrt(requests)); n when the pilot already meets it or has no interval, never more than `cap`."""
    if width is None or width <= precision or n >= cap:
        return n
    return min(cap, math.ceil(n * (width / precision) ** 2))


def half_width(ci: list[float] | None, value) -> float | None:
    """An interval's half-width relative to its figure (0.03 = ±3 %)."""
    if not ci or not value:
        return None
    return (ci[1] - ci[0]) / 2 / abs(value)


def _ci(draws: np.ndarray) -> list[float]:
    lo, hi = np.nanpercentile(draws, (2.5, 97.5))
    return [round(float(lo), 4), round(float(hi), 4)]


def _scaled(measured, ratio: np.ndarray) -> list[float] | None:
    return None if measured is None else _ci(float(measured) * ratio)
