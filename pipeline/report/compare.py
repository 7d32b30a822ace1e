"""Two runs side by side: a change is a regression only when it is larger than the noise."""

from __future__ import annotations

import math
from pathlib import Path

from ..common.fmt import fmt
from ..common.lenient import pair
from ..run.record import RUN_DONE, STAGE_OK, RunRecord
from .records import (
    LATENCY_THRESHOLD,
    MIN_ABS_MS,
    BenchmarkFigures,
    CompareError,
    EvaluateFigures,
    ServeResult,
    Validation,
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
        "run_a": {"run_id": rec_a.run_id, "dir": str(dir_a), "status": rec_a.status},
        "run_b": {"run_id": rec_b.run_id, "dir": str(dir_b), "status": rec_b.status},
        **compare_records(rec_a, rec_b, latency_threshold),
    }
    result["text"] = _compare_text(result)
    return result


def compare_records(
    rec_a: RunRecord | dict, rec_b: RunRecord | dict, latency_threshold: float = LATENCY_THRESHOLD
) -> dict:
    """The verdicts of run record A against run record B (what `compare` and `history` flag), without the files."""
    rec_a, rec_b = RunRecord.of(rec_a), RunRecord.of(rec_b)
    same_hw = _machine(rec_a) == _machine(rec_b)
    result = {
        "same_recipe": rec_a.recipe_hash == rec_b.recipe_hash,
        "same_hardware": same_hw,
        "thresholds": {
            "latency_relative": latency_threshold,
            "latency_min_abs_ms": MIN_ABS_MS,
            "accuracy": "wider 95% CI half-width",
        },
        "artifacts": {},
        "findings": [],
    }
    if rec_a.status not in RUN_DONE and rec_b.status in RUN_DONE:
        result["findings"].append(f"run A did not complete (status {rec_a.status}); run B did")
    names = list(dict.fromkeys(["baseline", *artifact_names(rec_b), *artifact_names(rec_a)]))
    for name in names:
        result["artifacts"][name] = c = _compare_artifact(name, rec_a, rec_b, latency_threshold, same_hw)
        result["findings"] += [f"{name}: {f}" for f in c["regressions"]]
    result["regression"] = bool(result["findings"])
    return result


def _machine(rec: RunRecord) -> tuple:
    """The hardware a run measured on, as its record holds it (a part it does not hold reads as None)."""
    hw = rec.hardware
    return tuple(getattr(hw, k) if k in hw.model_fields_set else None for k in ("machine", "cpu", "cpus", "gpus"))


def _compare_artifact(name: str, a: RunRecord, b: RunRecord, thr: float, same_hw: bool) -> dict:
    out = {"accuracy": [], "latency": [], "regressions": [], "notes": []}
    in_a, in_b = name == "baseline" or name in artifact_names(a), name == "baseline" or name in artifact_names(b)
    if not in_a:
        out["notes"].append("not in run A")
        return out
    if not in_b:
        out["notes"].append("new in run A (nothing to compare)")
        return out
    _compare_outcome(name, a, b, out)
    ea, eb = EvaluateFigures.of(a, f"evaluate:{name}"), EvaluateFigures.of(b, f"evaluate:{name}")
    _compare_accuracy(ea, eb, out)
    _compare_validation(ea.validation or Validation(), eb.validation or Validation(), out)
    fa, fb = ea.fidelity, eb.fidelity
    if fa.kl_mean is not None and fb.kl_mean is not None:
        out["accuracy"].append(
            {
                "task": "fidelity",
                "metric": "kl_mean",
                "score_b": fb.kl_mean,
                "score_a": fa.kl_mean,
                "delta": fa.kl_mean - fb.kl_mean,
                "noise": None,
                "verdict": "informational",
            }
        )
    ba, bb = BenchmarkFigures.of(a, f"benchmark:{name}"), BenchmarkFigures.of(b, f"benchmark:{name}")
    for figure in _speed_figures(ba, bb):
        _judge_speed(figure, thr, same_hw, out)
    return out


def _compare_outcome(name: str, a: RunRecord, b: RunRecord, out: dict) -> None:
    """The artifact's gate (PASS to anything else is a regression) and each of its stages (ok to failed is one)."""
    art_a = a.artifact(name)
    ga, gb = art_a.gate, b.artifact(name).gate
    out["gate"] = [gb, ga]
    if gb == "PASS" and ga != "PASS" and name != "baseline":
        out["regressions"].append(
            f"gate {gb} -> {ga}" + (f" ({'; '.join(art_a.gate_failures)})" if ga == "FAIL" else "")
        )
    for kind in ("quantize", "evaluate", "benchmark", "package"):
        sa, sb = a.stage(f"{kind}:{name}").status, b.stage(f"{kind}:{name}").status
        if sb == STAGE_OK and sa not in (STAGE_OK, None):
            out["regressions"].append(f"{kind} stage {sa} (was ok)")


def _compare_accuracy(ea: EvaluateFigures, eb: EvaluateFigures, out: dict) -> None:
    """Recovery per task/metric, judged against the wider CI half-width."""
    rows_b = {(c.task, c.metric): c for c in eb.comparison}
    for ra in ea.comparison:
        rb = rows_b.get((ra.task, ra.metric))
        if not rb or ra.recovery is None or rb.recovery is None:
            continue
        hws = [h for h in (ra.halfwidth(), rb.halfwidth()) if h is not None]
        tol = max(hws) if hws else None
        d = ra.recovery - rb.recovery
        verdict = (
            "not judged (no CI)"
            if tol is None
            else ("regression" if d < -tol else "improved" if d > tol else "within noise")
        )
        out["accuracy"].append(
            {
                "task": ra.task,
                "metric": ra.metric,
                "recovery_b": rb.recovery,
                "recovery_a": ra.recovery,
                "score_b": rb.artifact,
                "score_a": ra.artifact,
                "delta": d,
                "noise": tol,
                "verdict": verdict,
            }
        )
        if verdict == "regression":
            out["regressions"].append(
                f"{ra.task}/{ra.metric} recovery {rb.recovery:.3f} -> {ra.recovery:.3f} ({d:+.3f}, beyond the CI ±{tol:.3f})"
            )


def _compare_validation(va: Validation, vb: Validation, out: dict) -> None:
    """The validation score, judged by its binomial CI, where the evaluate stage did not compare it itself."""
    has_val_row = any(x["task"] == "validation" for x in out["accuracy"])  # the evaluate stage compares it, with a CI
    if has_val_row or va.score is None or vb.score is None:
        return
    hws = [
        1.96 * math.sqrt(max(v.score * (1 - v.score), 1 / v.n) / v.n)
        for v in (va, vb)
        if v.n is not None and v.n > 0 and 0 <= v.score <= 1
    ]
    tol = max(hws) if hws else None
    d = va.score - vb.score
    verdict = (
        "not judged (no n)"
        if tol is None
        else ("regression" if d < -tol else "improved" if d > tol else "within noise")
    )
    out["accuracy"].append(
        {
            "task": "validation",
            "metric": va.metric or vb.metric,
            "score_b": vb.score,
            "score_a": va.score,
            "delta": d,
            "noise": tol,
            "verdict": verdict,
        }
    )
    if verdict == "regression":
        out["regressions"].append(
            f"validation {va.metric} {vb.score:.3f} -> {va.score:.3f} ({d:+.3f}, beyond the CI ±{tol:.3f})"
        )


def _speed_figures(ba: BenchmarkFigures, bb: BenchmarkFigures) -> list[tuple]:
    """(label, unit, A, B, lower is better, factor to ms or None, A's 95% interval, B's) of each speed figure."""
    oa, ob, ga, gb = ba.offline, bb.offline, ba.best, bb.best
    figures = [
        ("batch-1 latency", "s", oa.latency_s_batch1, ob.latency_s_batch1, True, 1000.0, None, None),
        ("offline throughput", "tok/s", oa.throughput_tok_s, ob.throughput_tok_s, False, None, None, None),
        ("goodput at the SLO", "req/s", ga.goodput, gb.goodput, False, None, ga.goodput_ci95, gb.goodput_ci95),
    ]
    res_b = {_result_key(r): r for r in bb.results}
    for r in ba.results:
        k = _result_key(r)
        rb = res_b.get(k)
        if not rb:
            continue
        where = f"{k[0]}/{k[1]} c={k[2]}"
        for label, get, ci, unit, lower in (
            ("TTFT p50", lambda x: x.ttft_ms.p50_or_mean(), lambda x: x.ttft_ms.p50_ci95, "ms", True),
            ("TPOT p50", lambda x: x.tpot_ms.p50_or_mean(), lambda x: x.tpot_ms.p50_ci95, "ms", True),
            (
                "output throughput",
                lambda x: x.output_throughput,
                lambda x: pair(x.ci95.get("output_throughput")),
                "tok/s",
                False,
            ),
        ):
            figures.append(
                (f"{label} {where}", unit, get(r), get(rb), lower, 1.0 if unit == "ms" else None, ci(r), ci(rb))
            )
    return figures


def _judge_speed(figure: tuple, thr: float, same_hw: bool, out: dict) -> None:
    """A latency/throughput figure: relative threshold (and a floor in ms), overlapping intervals, same hardware only."""
    label, unit, va_, vb_, lower, to_ms, ci_a, ci_b = figure
    if va_ is None or vb_ is None or vb_ == 0:
        return
    rel = va_ / vb_ - 1
    worse = rel > thr if lower else rel < -thr
    better = rel < -thr if lower else rel > thr
    if to_ms is not None and abs(va_ - vb_) * to_ms < MIN_ABS_MS:
        worse = better = False
    if ci_a and ci_b and not (ci_a[1] < ci_b[0] or ci_b[1] < ci_a[0]):  # both measured with intervals, and they overlap
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


def _span(ci: list[float]) -> str:
    return f"[{fmt(ci[0])}, {fmt(ci[1])}]"


def _result_key(r: ServeResult) -> tuple:
    return r.variant, r.workload, r.concurrency


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
