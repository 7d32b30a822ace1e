"""A recipe's nights side by side: per artifact, across runs, the figures that decide a release, as trends.

`quantpipe history OUTPUT_DIR` writes OUTPUT_DIR/history.html (self-contained, offline; inline SVG plots whose points
link to their run's report) and history.json from the runs in OUTPUT_DIR/runs/. Each run is judged against its recipe's
last good run before it by `quantpipe compare`'s rule, so a point is flagged only where a change is beyond the noise.

    quantpipe history out/demo --last 14
    scripts/nightly.sh recipes/demo.yaml      # refreshes it after each night
"""

from __future__ import annotations

import io
import json
import os
import re
import time
from pathlib import Path

from .report.compare import compare_records
from .report.records import TEMPLATES
from .report.summary import summarize
from .run.record import RunRecord

FIGURES = [  # key, title, unit, lower is better, log scale
    ("recovery", "Accuracy recovery (worst task, 95% CI)", "", False, False),
    ("kl_mean", "KL vs baseline", "", True, True),
    ("goodput", "Goodput at the SLO", "req/s", False, False),
    ("ttft_p99_ms", "TTFT p99 at the best point", "ms", True, False),
    ("tpot_p99_ms", "TPOT p99 at the best point", "ms", True, False),
    ("size_bytes", "Size", "MiB", True, False),
]
# which compare findings flag which figure
FLAGS = {
    "recovery": re.compile(r"recovery|validation"),
    "goodput": re.compile(r"goodput"),
    "ttft_p99_ms": re.compile(r"TTFT"),
    "tpot_p99_ms": re.compile(r"TPOT"),
    "gate": re.compile(r"^gate |stage "),
}
DONE = ("ok", "gate_failed", "failed")


class HistoryError(Exception):
    """An output directory without runs to show; the message says what to do."""


def load_runs(out_dir: Path, last: int | None = None) -> list[tuple[RunRecord, Path]]:
    """(run record, run folder) of every finished run in out_dir/runs, oldest first; the last `last` of them."""
    runs_dir = Path(out_dir) / "runs"
    if not runs_dir.is_dir():
        raise HistoryError(f"{out_dir}: no runs/ folder; give the output_dir of a recipe that `quantpipe run` has run")
    found = []
    for f in sorted(runs_dir.glob("*/run.json")):
        try:
            raw = json.loads(f.read_text())
        except (OSError, ValueError):
            continue  # a damaged record is skipped, not fatal: the others still make a history
        if RunRecord.is_record(raw):
            rec = RunRecord.of(raw)
            if rec.status in DONE:
                found.append((rec, f.parent))
    found.sort(key=lambda x: (x[0].started_at or "", x[0].run_id or ""))
    if not found:
        raise HistoryError(f"{runs_dir}: no finished run recorded there yet; run `quantpipe run RECIPE` first")
    return found[-last:] if last else found


def build(out_dir: Path, last: int | None = None) -> dict:
    """history.json's content: the runs, and per artifact the series of each figure with its flags."""
    out_dir = Path(out_dir)
    runs = load_runs(out_dir, last)
    everything = load_runs(out_dir)  # the reference of the first shown run may be older than --last
    result = {
        "out_dir": str(out_dir.resolve()),
        "generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "runs": [],
        "artifacts": {},
        "regressions": [],
    }
    for rec, run_dir in runs:
        s = summarize(rec)
        ref = _last_good(rec, everything)
        cmp = compare_records(rec, ref[0]) if ref else None
        report = run_dir / "report.html"
        link = os.path.relpath(report, out_dir) if report.is_file() else None
        run = {
            "run_id": rec.run_id,
            "recipe_name": rec.recipe_name,
            "started_at": rec.started_at,
            "status": rec.status,
            "report": link,
            "dir": str(run_dir),
            "hardware": s["provenance"]["hardware_text"],
            "recommended": s["recommendation"].get("choice"),
            "against": ref[0].run_id if ref else None,
            "same_hardware": cmp["same_hardware"] if cmp else None,
            "findings": cmp["findings"] if cmp else [],
        }
        result["runs"].append(run)
        result["regressions"] += [{"run_id": run["run_id"], "finding": f} for f in run["findings"]]
        for r in s["rows"]:
            art = result["artifacts"].setdefault(r["artifact"], {"points": []})
            found = [f for f in (cmp or {}).get("artifacts", {}).get(r["artifact"], {}).get("regressions", [])]
            bp = r.get("best_point") or {}
            art["points"].append(
                {
                    "run_id": run["run_id"],
                    "started_at": run["started_at"],
                    "report": link,
                    "gate": r["gate"],
                    "recommended": run["recommended"] == r["artifact"],
                    "recovery": r["recovery"],
                    "recovery_ci": r.get("recovery_ci"),
                    "kl_mean": r["kl_mean"],
                    "goodput": r["goodput"],
                    "goodput_ci": r.get("goodput_ci"),
                    "ttft_p99_ms": bp.get("ttft_p99_ms"),
                    "ttft_p99_ci": bp.get("ttft_p99_ci"),
                    "tpot_p99_ms": bp.get("tpot_p99_ms"),
                    "tpot_p99_ci": bp.get("tpot_p99_ci"),
                    "size_bytes": r["size_bytes"],
                    "findings": found,
                    "flags": sorted({k for k, rx in FLAGS.items() for f in found if rx.search(f)}),
                }
            )
    for run, label in zip(result["runs"], _labels(result["runs"])):
        run["label"] = label
    return result


def _last_good(rec: RunRecord, runs: list[tuple[RunRecord, Path]]) -> tuple[RunRecord, Path] | None:
    """The latest run of the same recipe before `rec` with status ok (what `compare --against last-good` picks)."""
    start = rec.started_at or ""
    good = [
        (r, d)
        for r, d in runs
        if r.status == "ok"
        and r.recipe_name == rec.recipe_name
        and r.run_id != rec.run_id
        and (r.started_at or "") <= start
    ]
    return good[-1] if good else None


def write_history(out_dir: Path, last: int | None = None) -> list[Path]:
    """Write history.json and history.html into out_dir; return their paths."""
    out_dir = Path(out_dir)
    data = build(out_dir, last)
    plots = trend_plots(data)
    html = _render(data, plots)
    paths = [out_dir / "history.json", out_dir / "history.html"]
    _atomic(paths[0], json.dumps(data, indent=2, default=str) + "\n")
    _atomic(paths[1], html)
    return paths


def _label(run: dict, seconds: bool = False) -> str:
    """A run's axis label: its start, "12-02 01:43" (with seconds where two runs start in the same minute)."""
    t = str(run.get("started_at") or run.get("run_id") or "?")
    return t[5 : 19 if seconds else 16].replace("T", " ") if len(t) >= 19 else t


def _labels(runs: list[dict]) -> list[str]:
    short = [_label(r) for r in runs]
    return short if len(set(short)) == len(short) else [_label(r, seconds=True) for r in runs]


def trend_plots(data: dict) -> list[dict]:
    """One SVG per figure: a line per artifact, 95% intervals as error bars, flagged points ringed, each linked to its report."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = data["runs"]
    index = {r["run_id"]: i for i, r in enumerate(runs)}
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colours = {
        name: cycle[i % len(cycle)] for i, name in enumerate(data["artifacts"])
    }  # one colour per artifact in every plot
    plots = []
    with plt.rc_context({"svg.fonttype": "none", "svg.hashsalt": "quantpipe"}):
        for key, title, unit, lower, log in FIGURES:
            series = [
                (name, [p for p in a["points"] if p.get(key) is not None]) for name, a in data["artifacts"].items()
            ]
            series = [(n, ps) for n, ps in series if ps and not (key in ("recovery", "kl_mean") and n == "baseline")]
            if not series:
                continue
            fig, ax = plt.subplots(figsize=(6.2, 3.3))
            fig.subplots_adjust(left=0.13, right=0.78, bottom=0.27, top=0.88)
            for k, (name, ps) in enumerate(series):
                c = colours[name]
                xs = [
                    index[p["run_id"]] + (k - (len(series) - 1) / 2) * 0.04 for p in ps
                ]  # a small dodge keeps equal points apart
                ys = [p[key] / 2**20 if key == "size_bytes" else p[key] for p in ps]
                ci_key = {
                    "recovery": "recovery_ci",
                    "goodput": "goodput_ci",
                    "ttft_p99_ms": "ttft_p99_ci",
                    "tpot_p99_ms": "tpot_p99_ci",
                }.get(key)
                cis = [p.get(ci_key) if ci_key else None for p in ps]
                if any(cis):
                    lo = [y - ci[0] if ci else 0 for y, ci in zip(ys, cis)]
                    hi = [ci[1] - y if ci else 0 for y, ci in zip(ys, cis)]
                    ax.errorbar(xs, ys, yerr=[lo, hi], fmt="none", ecolor=c, alpha=0.55, capsize=3, lw=1)
                ax.plot(xs, ys, "-", color=c, lw=1.2, alpha=0.8, label=name)
                fails = [p["gate"] == "FAIL" for p in ps]
                pts = ax.scatter(xs, ys, s=34, color=c, marker="o", zorder=3)
                pts.set_urls([p["report"] for p in ps])
                bad = [(x, y) for x, y, f in zip(xs, ys, fails) if f]
                if bad:
                    ax.scatter(*zip(*bad), s=60, marker="x", color="#b3261e", zorder=4)
                flagged = [(x, y, p) for x, y, p in zip(xs, ys, ps) if key in p["flags"]]
                if flagged:
                    ring = ax.scatter(
                        [x for x, _, _ in flagged],
                        [y for _, y, _ in flagged],
                        s=190,
                        facecolors="none",
                        edgecolors="#d62728",
                        linewidths=2,
                        zorder=5,
                    )
                    ring.set_urls([p["report"] for _, _, p in flagged])
            if log:
                ax.set_yscale("log")
            ax.set_xticks(range(len(runs)), [r["label"] for r in runs], rotation=35, ha="right", fontsize=7)
            ax.set_xlim(-0.5, len(runs) - 0.5)
            ax.set_title(title + (" — lower is better" if lower else " — higher is better"), fontsize=9.5)
            ax.set_ylabel(unit or key.replace("_", " "), fontsize=8)
            ax.tick_params(axis="y", labelsize=7)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
            buf = io.StringIO()
            fig.savefig(buf, format="svg")
            plt.close(fig)
            svg = buf.getvalue()
            svg = svg[svg.index("<svg") :]
            plots.append({"name": key, "title": title, "svg": svg})
    return plots


def _render(data: dict, plots: list[dict]) -> str:
    import jinja2
    import markupsafe

    from .common.fmt import fmt, human_bytes

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        autoescape=True,
        undefined=jinja2.ChainableUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["fmt"] = fmt
    env.filters["bytes"] = human_bytes
    return env.get_template("history.html.j2").render(
        h=data,
        plots=[{**p, "svg": markupsafe.Markup(p["svg"])} for p in plots],
        gate=lambda a, run_id: next(
            (p for p in (data["artifacts"].get(a) or {}).get("points", []) if p["run_id"] == run_id), None
        ),
    )


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
