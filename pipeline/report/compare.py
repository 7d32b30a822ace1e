"""Two runs side by side: a change is a regression only when it is larger than the noise."""

from __future__ import annotations

import math
from pathlib import Path

from ..common.fmt import fmt
from .records import (
    LATENCY_THRESHOLD,
    MIN_ABS_MS,
    STAGE_OK,
    CompareError,
    _d,
    _int,
    _l,
    _metrics,
    _num,
    _pair,
    _pct,
    _recovery_halfwidth,
    _s,
    accuracy_rows,
    artifact_names,
)
from .run_lookup import last_good, load_run


def compare_runs(
    run_a: Path, run_b: Path | None, against: str | None = None, latency_threshold: float = LATENCY_THRESHOLD
) -> dict:
    """Compare run A (candidate) with run B (reference, or A's last good run). A regression is beyond the noise only:
    recovery down by over the wider 95% CI half-width; speed worse by over `latency_threshold`, same hardware only."""
    rec_a, dir_a = load_run(run_a)
    if run_b is None:
        if against != "last-good":
            raise CompareError("give RUN_B, or --against last-good")
        dir_b = last_good(dir_a, rec_a)
        rec_b, dir_b = load_run(dir_b)
    else:
        rec_b, dir_b = load_run(run_b)
    if dir_a.resolve() == dir_b.resolve():
        raise CompareError(f"{dir_a}: RUN_A and RUN_B are the same run")
    result = {
        "run_a": {"run_id": rec_a.get("run_id"), "dir": str(dir_a), "status": rec_a.get("status")},
        "run_b": {"run_id": rec_b.get("run_id"), "dir": str(dir_b), "status": rec_b.get("status")},
        **compare_records(rec_a, rec_b, latency_threshold),
    }
    result["text"] = _compare_text(result)
    return result


def compare_records(rec_a: dict, rec_b: dict, latency_threshold: float = LATENCY_THRESHOLD) -> dict:
    """The verdicts of run record A against run record B (what `compare` and `history` flag), without the files."""
    hw_keys = ("machine", "cpu", "cpus", "gpus")
    same_hw = all(_d(rec_a.get("hardware")).get(k) == _d(rec_b.get("hardware")).get(k) for k in hw_keys)
    result = {
        "same_recipe": rec_a.get("recipe_hash") == rec_b.get("recipe_hash"),
        "same_hardware": same_hw,
        "thresholds": {
            "latency_relative": latency_threshold,
            "latency_min_abs_ms": MIN_ABS_MS,
            "accuracy": "wider 95% CI half-width",
        },
        "artifacts": {},
        "findings": [],
    }
    if rec_a.get("status") not in ("ok", "gate_failed") and rec_b.get("status") in ("ok", "gate_failed"):
        result["findings"].append(f"run A did not complete (status {rec_a.get('status')}); run B did")
    names = list(dict.fromkeys(["baseline", *artifact_names(rec_b), *artifact_names(rec_a)]))
    for name in names:
        result["artifacts"][name] = c = _compare_artifact(name, rec_a, rec_b, latency_threshold, same_hw)
        result["findings"] += [f"{name}: {f}" for f in c["regressions"]]
    result["regression"] = bool(result["findings"])
    return result


def _compare_artifact(name: str, a: dict, b: dict, thr: float, same_hw: bool) -> dict:
    out = {"accuracy": [], "latency": [], "regressions": [], "notes": []}
    in_a, in_b = name == "baseline" or name in artifact_names(a), name == "baseline" or name in artifact_names(b)
    if not in_a:
        out["notes"].append("not in run A")
        return out
    if not in_b:
        out["notes"].append("new in run A (nothing to compare)")
        return out
    ga, gb = _d(_d(a.get("artifacts")).get(name)).get("gate"), _d(_d(b.get("artifacts")).get(name)).get("gate")
    out["gate"] = [gb, ga]
    if gb == "PASS" and ga != "PASS" and name != "baseline":
        out["regressions"].append(
            f"gate {gb} -> {ga}"
            + (
                f" ({'; '.join(str(f) for f in _l(_d(_d(a.get('artifacts')).get(name)).get('gate_failures')))})"
                if ga == "FAIL"
                else ""
            )
        )
    for kind in ("quantize", "evaluate", "benchmark", "package"):
        sa = _d(_d(a.get("stages")).get(f"{kind}:{name}")).get("status")
        sb = _d(_d(b.get("stages")).get(f"{kind}:{name}")).get("status")
        if sb == STAGE_OK and sa not in (STAGE_OK, None):
            out["regressions"].append(f"{kind} stage {sa} (was ok)")
    # accuracy: recovery per task/metric, judged against the wider CI half-width
    ea, eb = _metrics(a, f"evaluate:{name}"), _metrics(b, f"evaluate:{name}")
    rows_b = {(r["task"], r["metric"]): r for r in accuracy_rows(eb)}
    for ra in accuracy_rows(ea):
        rb = rows_b.get((ra["task"], ra["metric"]))
        if not rb or ra["recovery"] is None or rb["recovery"] is None:
            continue
        hws = [h for h in (_recovery_halfwidth(ra), _recovery_halfwidth(rb)) if h is not None]
        tol = max(hws) if hws else None
        d = ra["recovery"] - rb["recovery"]
        verdict = (
            "not judged (no CI)"
            if tol is None
            else ("regression" if d < -tol else "improved" if d > tol else "within noise")
        )
        out["accuracy"].append(
            {
                "task": ra["task"],
                "metric": ra["metric"],
                "recovery_b": rb["recovery"],
                "recovery_a": ra["recovery"],
                "score_b": rb["value"],
                "score_a": ra["value"],
                "delta": d,
                "noise": tol,
                "verdict": verdict,
            }
        )
        if verdict == "regression":
            out["regressions"].append(
                f"{ra['task']}/{ra['metric']} recovery {rb['recovery']:.3f} -> {ra['recovery']:.3f} ({d:+.3f}, beyond the CI ±{tol:.3f})"
            )
    va, vb = _d(ea.get("validation")), _d(eb.get("validation"))
    has_val_row = any(x["task"] == "validation" for x in out["accuracy"])  # the evaluate stage compares it, with a CI
    if not has_val_row and _num(va.get("score")) is not None and _num(vb.get("score")) is not None:
        hws = [
            1.96 * math.sqrt(max(v["score"] * (1 - v["score"]), 1 / v["n"]) / v["n"])
            for v in (va, vb)
            if isinstance(v.get("n"), int) and v["n"] > 0 and 0 <= v["score"] <= 1
        ]
        tol = max(hws) if hws else None
        d = va["score"] - vb["score"]
        verdict = (
            "not judged (no n)"
            if tol is None
            else ("regression" if d < -tol else "improved" if d > tol else "within noise")
        )
        out["accuracy"].append(
            {
                "task": "validation",
                "metric": va.get("metric") or vb.get("metric"),
                "score_b": vb["score"],
                "score_a": va["score"],
                "delta": d,
                "noise": tol,
                "verdict": verdict,
            }
        )
        if verdict == "regression":
            out["regressions"].append(
                f"validation {va.get('metric')} {vb['score']:.3f} -> {va['score']:.3f} ({d:+.3f}, beyond the CI ±{tol:.3f})"
            )
    fa, fb = _d(ea.get("fidelity")), _d(eb.get("fidelity"))
    if _num(fa.get("kl_mean")) is not None and _num(fb.get("kl_mean")) is not None:
        out["accuracy"].append(
            {
                "task": "fidelity",
                "metric": "kl_mean",
                "score_b": fb["kl_mean"],
                "score_a": fa["kl_mean"],
                "delta": fa["kl_mean"] - fb["kl_mean"],
                "noise": None,
                "verdict": "informational",
            }
        )
    # latency and throughput: relative threshold, same hardware only
    ba, bb = _metrics(a, f"benchmark:{name}"), _metrics(b, f"benchmark:{name}")
    figures = []
    oa, ob = _d(ba.get("offline")), _d(bb.get("offline"))
    figures.append(
        (
            "batch-1 latency",
            "s",
            _num(oa.get("latency_s_batch1")),
            _num(ob.get("latency_s_batch1")),
            True,
            1000.0,
            None,
            None,
        )
    )
    figures.append(
        (
            "offline throughput",
            "tok/s",
            _num(oa.get("throughput_tok_s")),
            _num(ob.get("throughput_tok_s")),
            False,
            None,
            None,
            None,
        )
    )
    ga, gb = _d(ba.get("best")), _d(bb.get("best"))
    figures.append(
        (
            "goodput at the SLO",
            "req/s",
            _num(ga.get("goodput")),
            _num(gb.get("goodput")),
            False,
            None,
            _pair(ga.get("goodput_ci95")),
            _pair(gb.get("goodput_ci95")),
        )
    )
    res_b = {_result_key(r): r for r in _l(bb.get("results")) if isinstance(r, dict)}
    for r in _l(ba.get("results")):
        if not isinstance(r, dict):
            continue
        k = _result_key(r)
        rb = res_b.get(k)
        if not rb:
            continue
        where = f"{k[0]}/{k[1]} c={k[2]}"
        for label, get, ci, unit, lower in (
            (
                "TTFT p50",
                lambda x: _p50_or_mean(x.get("ttft_ms")),
                lambda x: _pair(_d(x.get("ttft_ms")).get("p50_ci95")),
                "ms",
                True,
            ),
            (
                "TPOT p50",
                lambda x: _p50_or_mean(x.get("tpot_ms")),
                lambda x: _pair(_d(x.get("tpot_ms")).get("p50_ci95")),
                "ms",
                True,
            ),
            (
                "output throughput",
                lambda x: _num(x.get("output_throughput")),
                lambda x: _pair(_d(x.get("ci95")).get("output_throughput")),
                "tok/s",
                False,
            ),
        ):
            figures.append(
                (f"{label} {where}", unit, get(r), get(rb), lower, 1.0 if unit == "ms" else None, ci(r), ci(rb))
            )
    for label, unit, va_, vb_, lower, to_ms, ci_a, ci_b in figures:
        if va_ is None or vb_ is None or vb_ == 0:
            continue
        rel = va_ / vb_ - 1
        worse = rel > thr if lower else rel < -thr
        better = rel < -thr if lower else rel > thr
        if to_ms is not None and abs(va_ - vb_) * to_ms < MIN_ABS_MS:
            worse = better = False
        if (
            ci_a and ci_b and not (ci_a[1] < ci_b[0] or ci_b[1] < ci_a[0])
        ):  # both measured with intervals, and they overlap
            worse = better = False
        verdict = (
            "not judged (different hardware)"
            if not same_hw
            else ("regression" if worse else "improved" if better else "within noise")
        )
        out["latency"].append(
            {
                "figure": label,
                "unit": unit,
                "b": vb_,
                "a": va_,
                "relative": rel,
                "lower_is_better": lower,
                "verdict": verdict,
                "ci_b": ci_b,
                "ci_a": ci_a,
            }
        )
        if verdict == "regression":
            out["regressions"].append(
                f"{label} {fmt(vb_)} -> {fmt(va_)} {unit} ({rel:+.1%}, threshold {thr:.0%}"
                + (f"; 95% intervals {_span(ci_b)} -> {_span(ci_a)}" if ci_a and ci_b else "")
                + ")"
            )
    return out


def _p50_or_mean(figure) -> float | None:
    """A latency's p50, or its mean where the run recorded no p50."""
    return _pct(figure, "p50") if _pct(figure, "p50") is not None else _pct(figure, "mean")


def _span(ci: list[float]) -> str:
    return f"[{fmt(ci[0])}, {fmt(ci[1])}]"


def _result_key(r: dict) -> tuple:
    return _s(r.get("variant")), _s(r.get("workload")), _int(r.get("concurrency"))


def _compare_text(r: dict) -> str:
    a, b = r["run_a"], r["run_b"]
    lines = [
        f"run A (candidate): {a['run_id']} [{a['status']}]  {a['dir']}",
        f"run B (reference): {b['run_id']} [{b['status']}]  {b['dir']}",
        f"recipe: {'same' if r['same_recipe'] else 'CHANGED'}; hardware: {'same' if r['same_hardware'] else 'DIFFERENT (latency not judged)'}; "
        f"noise: accuracy within the wider 95% CI, latency within {r['thresholds']['latency_relative']:.0%} (or {MIN_ABS_MS:g} ms) "
        "or within overlapping 95% intervals",
    ]
    for name, c in r["artifacts"].items():
        head = f"\n[{name}]"
        if c.get("gate") and any(c["gate"]):
            head += f" gate {c['gate'][0]} -> {c['gate'][1]}"
        if c["notes"]:
            head += " " + "; ".join(c["notes"])
        lines.append(head)
        for x in c["accuracy"]:
            if "recovery_a" in x:
                lines.append(
                    f"  accuracy {x['task']}/{x['metric']}: recovery {fmt(x['recovery_b'])} -> {fmt(x['recovery_a'])} "
                    f"({x['delta']:+.3f}{', noise ±' + fmt(x['noise']) if x['noise'] is not None else ''})  {x['verdict']}"
                )
            else:
                lines.append(
                    f"  accuracy {x['task']}/{x['metric']}: {fmt(x['score_b'], 4)} -> {fmt(x['score_a'], 4)} "
                    f"({x['delta']:+.4g}{', noise ±' + fmt(x['noise']) if x['noise'] is not None else ''})  {x['verdict']}"
                )
        quiet = [x for x in c["latency"] if x["verdict"] == "within noise"]
        for x in c["latency"]:
            if x not in quiet:  # only what moved beyond the noise, or could not be judged
                lines.append(
                    f"  speed    {x['figure']}: {fmt(x['b'])} -> {fmt(x['a'])} {x['unit']} ({x['relative']:+.1%})  {x['verdict']}"
                )
        if quiet:
            worst = max(quiet, key=lambda x: x["relative"] if x["lower_is_better"] else -x["relative"])
            lines.append(
                f"  speed    {len(quiet)} figure(s) within noise (largest change: {worst['figure']} {worst['relative']:+.1%})"
            )
        for f in c["regressions"]:
            if f.startswith("gate ") or " stage " in f:  # the figures above carry their own verdicts
                lines.append(f"  REGRESSION {f}")
    lines.append("")
    if r["regression"]:
        lines.append(f"REGRESSION: {len(r['findings'])} finding(s) beyond the noise:")
        lines += [f"  - {f}" for f in r["findings"]]
    else:
        lines.append("no regression: every change is within the noise")
    return "\n".join(lines)
