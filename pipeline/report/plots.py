"""The report's plots (matplotlib, offline): accuracy against speed, with the Pareto front."""

from __future__ import annotations

import math
from pathlib import Path

from .labels import place_labels
from .summary import pareto

SPEED_SOURCE = {  # plot footers: [served sweep only, offline benchmarks ran]
    "latency_s_batch1": [
        "batch-1 latency: vllm bench serve, mean end-to-end latency at concurrency 1",
        "offline vllm bench latency (batch 1)",
    ],
    "throughput_tok_s": [
        "throughput: vllm bench serve, output tokens/s at the best concurrency",
        "offline vllm bench throughput",
    ],
}


def _footer(prov: dict, extra: str = "") -> str:
    bits = [
        prov["hardware_text"],
        f"vLLM {prov['vllm']}" if prov.get("vllm") else None,
        f"quantpipe {(prov.get('git_commit') or '?')[:12]}",
        prov["command"],
        extra or None,
    ]
    return " · ".join(b for b in bits if b)


def make_plots(summary: dict, plot_dir: Path) -> list[dict]:
    """PNG plots (matplotlib, Agg) with how they were obtained printed in each; [] entries are skipped plots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir.mkdir(parents=True, exist_ok=True)
    prov = summary["provenance"]
    wl = summary.get("workload") or {}
    wl_txt = (
        f"workload {wl.get('name')}: {wl.get('input_len')} in / {wl.get('output_len')} out tokens, {wl.get('num_prompts')} prompts"
        if wl
        else ""
    )
    rows = summary["rows"]
    plots = []

    def save(fig, name, title, caption, boxes=None):
        fig.text(
            0.01,
            0.005,
            _footer(prov, caption.get("footer", "")),
            fontsize=6.5,
            color="#555",
            ha="left",
            va="bottom",
            wrap=True,
        )
        path = plot_dir / f"{name}.png"
        scale, height = 110 / fig.dpi, fig.bbox.height
        # label boxes in the PNG's pixels (origin top left), so that a test can check that no two overlap
        label_px = [
            [
                round(b[0] * scale, 1),
                round((height - b[3]) * scale, 1),
                round(b[2] * scale, 1),
                round((height - b[1]) * scale, 1),
            ]
            for b in boxes or []
        ]
        fig.savefig(path, dpi=110)
        plt.close(fig)
        plots.append(
            {
                "name": name,
                "title": title,
                "caption": caption["text"] + " Obtained on " + _footer(prov, caption.get("footer", "")) + ".",
                "path": str(path),
                "file": f"plots/{name}.png",
                **({"labels": label_px} if boxes is not None else {}),
            }
        )

    quality = summary.get("quality_axis") or "recovery"
    for speed, label, lower, name in (
        ("latency_s_batch1", "batch-1 latency (s)", True, "accuracy_vs_latency"),
        ("throughput_tok_s", "throughput (tokens/s)", False, "accuracy_vs_throughput"),
    ):
        pts = [
            r
            for r in rows
            if r[speed] is not None and (r[quality] is not None or (quality == "kl_mean" and r["baseline"]))
        ]
        if not [r for r in pts if r[quality] is not None]:
            continue
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        fig.subplots_adjust(bottom=0.2)
        front = pareto(pts, speed, lower, quality)
        labels = []
        for r in pts:
            if (
                quality == "kl_mean" and r["baseline"]
            ):  # KL of the baseline is 0 by definition: a line at its speed, not a point
                ax.axvline(r[speed], color="#777", ls=":", lw=1.2, zorder=1)
                continue
            colour = "#777" if r["baseline"] else ("#2a7" if r["gate"] == "PASS" else "#c33")
            marker = "s" if r["baseline"] else ("o" if r["gate"] == "PASS" else "X")
            on = r["artifact"] in front
            ci = r.get("recovery_ci") if quality == "recovery" else None
            if ci:
                ax.errorbar(
                    [r[speed]],
                    [r[quality]],
                    yerr=[[r[quality] - ci[0]], [ci[1] - r[quality]]],
                    fmt="none",
                    ecolor=colour,
                    elinewidth=1,
                    capsize=3,
                    alpha=0.7,
                    zorder=2,
                )
            ax.scatter(
                r[speed],
                r[quality],
                s=90 if on else 50,
                c=colour,
                marker=marker,
                edgecolors="k" if on else "none",
                zorder=3,
            )
            labels.append((r[speed], r[quality], r["artifact"]))
        line = sorted((r for r in pts if r["artifact"] in front and r[quality] is not None), key=lambda r: r[speed])
        if len(line) > 1:
            ax.plot(
                [r[speed] for r in line],
                [r[quality] for r in line],
                "--",
                color="#246",
                lw=1.2,
                zorder=2,
                label="Pareto front",
            )
        elif line:
            ax.scatter([], [], edgecolors="k", c="w", label="Pareto front (outlined)")
        if quality == "kl_mean":
            ax.set_yscale("log")
            ax.set_ylabel("KL vs baseline (log) — lower is better")
            base = next((r for r in pts if r["baseline"]), None)
            if base is not None:
                ax.plot([], [], ":", color="#777", label="baseline (KL 0)")
        else:
            ax.set_ylabel("accuracy recovery, worst task (95% CI)")
        ax.set_xlabel(label + (" — lower is better" if lower else " — higher is better"))
        ax.margins(x=0.12, y=0.15)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
        what = "KL vs baseline" if quality == "kl_mean" else "Accuracy recovery"
        title = f"{what} vs {label.split(' (')[0]}"
        ax.set_title(title)
        boxes = place_labels(ax, labels)
        tie = (
            (
                " The artifacts' accuracy recoveries tie within their 95% CIs, so the quality axis is KL divergence from the baseline "
                "(log; the dotted line is the baseline's speed, its KL being 0)."
            )
            if quality == "kl_mean"
            else " Bars: the worst task's 95% CI (paired bootstrap)."
        )
        save(
            fig,
            name,
            title,
            {
                "text": f"Each point is an artifact (square: the unquantized baseline; green: passes every gate; red cross: fails one); "
                f"outlined points are on the Pareto front of {what.lower()} against {label.split(' (')[0]}; points that coincide share a label.{tie}",
                "footer": SPEED_SOURCE[speed][any(r.get("speed_source") == "offline" for r in pts)],
            },
            boxes,
        )

    served = [r for r in rows if r["serve"]]
    if served:
        fig, axes = plt.subplots(1, 3, figsize=(12, 3.9))
        fig.subplots_adjust(bottom=0.27, wspace=0.3)
        for r in served:
            cs = [int(c) for c in r["serve"] if c.isdigit()]
            for ax, k in zip(axes, ("output_throughput", "ttft_p99_ms", "tpot_p99_ms")):
                ys = [r["serve"][str(c)][k] for c in cs]
                ax.plot(
                    cs, [y if y is not None else math.nan for y in ys], "o-", label=f"{r['artifact']} ({r['variant']})"
                )
        for ax, t in zip(axes, ("output throughput (tok/s)", "TTFT p99 (ms)", "TPOT p99 (ms)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency")
            ax.set_title(t, fontsize=10)
            ax.grid(alpha=0.3)
        for k, ax in (("ttft_p99_ms", axes[1]), ("tpot_p99_ms", axes[2])):
            if summary["slo"].get(k):
                ax.axhline(summary["slo"][k], color="#c33", ls=":", lw=1, label="SLO")
        axes[0].legend(fontsize=7)
        save(
            fig,
            "concurrency",
            "Throughput and latency vs concurrency",
            {
                "text": "vllm bench serve at each concurrency, per artifact with its best engine variant.",
                "footer": wl_txt,
            },
        )

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
        ax.set_ylabel(
            "goodput at the SLO (req/s)" if metric == "best_goodput" else "output throughput at top concurrency (tok/s)"
        )
        ax.set_title("Engine variants")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
        save(
            fig,
            "variants",
            "Engine-variant comparison",
            {
                "text": "Each engine variant of the recipe, per artifact: "
                + (
                    "best goodput at the SLO over the concurrencies."
                    if metric == "best_goodput"
                    else "output throughput at the highest concurrency."
                ),
                "footer": wl_txt,
            },
        )
    timeline = _timeline(summary, plt)
    if timeline is not None:
        save(
            timeline,
            "timeline",
            "Where the time went: the run's stages by GPU",
            {
                "text": "Each bar is a stage that ran (cache hits are not drawn), on the GPU it was given (CPU: stages that use "
                "none); benchmarks have their GPU to themselves, quantize and evaluate stages share one. A benchmark whose engine sets "
                "kv_cache_memory_bytes shares its GPU while its server starts and answers the evaluation (pale) and has it to "
                "itself while it measures (solid)."
            },
        )
    return plots


KIND_COLOURS = {
    "merge": "#8c6d31",
    "quantize": "#3182bd",
    "evaluate": "#31a354",
    "benchmark": "#de2d26",
    "package": "#756bb1",
}


def _timeline(summary: dict, plt):
    """Gantt chart of the stages that ran: a lane per GPU (and one for CPU), overlapping stages on separate rows."""
    ran = [
        s
        for s in summary.get("stages") or []
        if s.get("start_s") is not None and s.get("end_s") is not None and s.get("cache") != "hit"
    ]
    if not ran:
        return None
    lanes = [f"GPU {d}" for d in sorted({d for s in ran for d in s["devices"]}, key=lambda d: (len(d), d))]
    lanes += ["CPU"] if any(not s["devices"] for s in ran) else []
    rows: dict[str, list[float]] = {lane: [] for lane in lanes}  # lane -> each row's last end
    bars = []
    for s in sorted(ran, key=lambda s: s["start_s"]):
        for lane in [f"GPU {d}" for d in s["devices"]] or ["CPU"]:
            free = [i for i, end in enumerate(rows[lane]) if end <= s["start_s"] + 1e-6]
            i = free[0] if free else len(rows[lane])
            rows[lane][i : i + 1] = [s["end_s"]]
            bars.append((lane, i, s))
    ys, y = {}, 0
    for lane in lanes:
        ys[lane] = y
        y += len(rows[lane]) + 0.5
    height = 1.3 + 0.3 * y
    fig, ax = plt.subplots(figsize=(7.6, height))
    fig.subplots_adjust(bottom=0.65 / height, top=1 - 0.35 / height, left=0.12)
    for lane, i, s in bars:
        colour = KIND_COLOURS.get(s["id"].split(":")[0], "#999")
        windows = [w for w in s.get("measured_s") or [] if None not in w]  # a shared benchmark: solid where it measured
        ax.barh(
            ys[lane] + i,
            s["end_s"] - s["start_s"],
            left=s["start_s"],
            height=0.8,
            color=colour,
            edgecolor="white",
            alpha=0.9 if s.get("status") == "ok" and not windows else 0.35,
        )
        for a, b in windows:
            ax.barh(ys[lane] + i, b - a, left=a, height=0.8, color=colour, edgecolor="white", alpha=0.95)
    ax.set_yticks([ys[lane] + (len(rows[lane]) - 1) / 2 for lane in lanes], lanes)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the run started")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in KIND_COLOURS.values()]
    ax.legend(
        handles, KIND_COLOURS.keys(), fontsize=7, ncol=5, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False
    )
    return fig
