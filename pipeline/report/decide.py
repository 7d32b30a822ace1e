"""Which artifact to ship: the recommendation rule (README, "Reading the report"), the runner-up, what separates them.
Among artifacts that pass every gate with all stages complete, the highest goodput at the SLO wins. Figures within
each other's noise tie (the wider 95% interval, else compare's 10% speed threshold); a tie goes to the better fidelity
(lower KL, then higher top-1 agreement), then the smaller size. Without an SLO, or when no passing artifact meets it,
throughput ranks instead; when nothing passing was benchmarked, the worst task's accuracy recovery does.

    recommend(summary["rows"], summary["slo"])["sentence"]
"""

from __future__ import annotations

import math

from ..common.fmt import fmt, human_bytes
from .records import LATENCY_THRESHOLD

RULE = (
    "Among artifacts that pass every gate, the highest goodput at the SLO; two within each other's intervals "
    "(else within 10%) tie, and a tie goes to the better fidelity (lower KL, then higher top-1 agreement), then the smaller size."
)
FIGURES = {
    "goodput": ("goodput at the SLO", "req/s"),
    "throughput_tok_s": ("throughput", "tok/s"),
    "recovery": ("accuracy recovery", ""),
}


def sig(v, digits: int = 3) -> str:
    """A figure to `digits` significant digits without scientific notation for ordinary sizes: 2.54, 173, 0.00056; '—' if None."""
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v != v:
        return "—"
    if v == 0 or isinstance(v, int):
        return str(v)
    mag = math.floor(math.log10(abs(v)))
    if mag >= digits - 1:
        return f"{v:.0f}"
    if mag < -4:
        return f"{v:.{digits - 1}e}"
    return f"{v:.{digits - 1 - mag}f}".rstrip("0").rstrip(".")


def slo_text(slo: dict) -> str:
    """{"ttft_p99_ms": 2000} -> "TTFT p99 ≤ 2000 ms"."""
    return ", ".join(
        f"{k.split('_')[0].upper()} {k.split('_')[1]} ≤ {v:g} ms" if k.count("_") >= 2 else f"{k} ≤ {v:g}"
        for k, v in slo.items()
    )


def interval(row: dict, figure: str) -> tuple[float, float] | None:
    """The figure's 95% interval as recorded (recovery: the worst task's CI; goodput: the benchmark's, if it gives one)."""
    ci = row.get(
        {
            "recovery": "recovery_ci",
            "goodput": "goodput_ci",
            "throughput_tok_s": "throughput_ci",
            "kl_mean": "kl_ci",
            "top1_agreement": "top1_ci",
        }.get(figure, "")
    )
    return (ci[0], ci[1]) if isinstance(ci, (list, tuple)) and len(ci) == 2 else None


def halfwidth(row: dict, figure: str) -> float | None:
    ci = interval(row, figure)
    if ci is not None:
        return (ci[1] - ci[0]) / 2
    v = row.get(figure)
    if figure in ("goodput", "throughput_tok_s") and isinstance(v, (int, float)):
        return LATENCY_THRESHOLD * abs(v)  # speed without an interval: compare's run-to-run noise
    return None


def ties(a: dict, b: dict, figure: str) -> bool:
    """a and b cannot be told apart on `figure`: their difference is within the wider of their noise bands."""
    va, vb = a.get(figure), b.get(figure)
    if va is None or vb is None:
        return False
    hws = [h for h in (halfwidth(a, figure), halfwidth(b, figure)) if h is not None]
    return abs(va - vb) <= (max(hws) if hws else 1e-12)


def fidelity_key(r: dict) -> tuple:
    kl, top1 = r.get("kl_mean"), r.get("top1_agreement")
    return (kl if kl is not None else math.inf, -(top1 if top1 is not None else -math.inf))


def fidelity_cmp(a: dict, b: dict) -> int:
    """-1 when a is the closer to the baseline, 1 when b is, 0 when their fidelity cannot be told apart: lower KL, then higher
    top-1 agreement, each beyond the wider of the two 95% intervals where the evaluate stage records them."""
    for figure, lower in (("kl_mean", True), ("top1_agreement", False)):
        va, vb = a.get(figure), b.get(figure)
        if va is None or vb is None:
            if va is not None or vb is not None:  # only one has the figure: that one
                return -1 if va is not None else 1
            continue
        if ties(a, b, figure) and (interval(a, figure) or interval(b, figure)):
            continue
        if va != vb:
            return (-1 if va < vb else 1) if lower else (-1 if va > vb else 1)
    return 0


def _size(r: dict) -> float:
    return r["size_bytes"] or math.inf


def recommend(rows: list[dict], slo: dict) -> dict:
    """The choice, the runner-up, what separates them, which artifacts failed which gate, and one sentence saying so."""
    arts = [r for r in rows if not r["baseline"]]
    passing = [r for r in arts if r["gate"] == "PASS" and not r["failed_stages"]]
    failed = [
        {"artifact": r["artifact"], "gate": r["gate"], "failures": r["gate_failures"], "stages": r["failed_stages"]}
        for r in arts
        if r not in passing
    ]
    out = {
        "passing": [r["artifact"] for r in passing],
        "failed": failed,
        "choice": None,
        "runner_up": None,
        "criterion": None,
        "figure": None,
        "tie": False,
        "decided_by": None,
        "separation": [],
        "unranked": [],
        "rule": RULE,
    }
    if not passing:
        if arts and all(r["gate"] == "NOT RUN" and not r["failed_stages"] for r in arts):
            out["sentence"] = (
                "No artifact is recommended: none was evaluated, so no release gate could pass (add an `evaluation:` section to the recipe)."
            )
        else:
            why = "; ".join(
                f"`{r['artifact']}` "
                + (
                    f"fails {', '.join(r['gate_failures'])}"
                    if r["gate_failures"]
                    else f"has stages that did not complete ({', '.join(r['failed_stages'])})"
                    if r["failed_stages"]
                    else f"gate {r['gate']}"
                )
                for r in arts
            )
            out["sentence"] = f"No artifact is recommended: none passes every gate ({why})."
        return out
    served = [r for r in passing if r["benchmarked"] and r["servable"] is not False]
    if slo and any((r["goodput"] or 0) > 0 for r in served):
        figure, ranked, criterion = "goodput", [r for r in served if (r["goodput"] or 0) > 0], "goodput at the SLO"
    elif any(r["throughput_tok_s"] is not None for r in served):
        figure, ranked, criterion = (
            "throughput_tok_s",
            [r for r in served if r["throughput_tok_s"] is not None],
            "throughput",
        )
    else:
        figure, criterion = "recovery", "accuracy, then fidelity, then size"
        ranked = [r for r in passing if r["recovery"] is not None] or list(passing)
    ranked.sort(
        key=lambda r: (
            -(r[figure] if r[figure] is not None else -math.inf),
            fidelity_key(r),
            r["size_bytes"] or math.inf,
        )
    )
    leader = ranked[0]
    tied = [r for r in ranked if r is leader or ties(leader, r, figure)]
    if len(tied) > 1:
        from functools import cmp_to_key

        tied.sort(key=cmp_to_key(lambda a, b: fidelity_cmp(a, b) or (_size(a) > _size(b)) - (_size(a) < _size(b))))
        choice, runner = tied[0], tied[1]
        decided_by = "fidelity" if fidelity_cmp(choice, runner) else "size"
    else:
        choice, runner = leader, (ranked[1] if len(ranked) > 1 else None)
        decided_by = figure
    unranked = [r for r in passing if r not in ranked]
    out |= {
        "choice": choice["artifact"],
        "runner_up": runner["artifact"] if runner else None,
        "criterion": criterion,
        "figure": figure,
        "tie": len(tied) > 1,
        "decided_by": decided_by,
        "separation": separation(choice, runner, decided_by, figure),
        "unranked": [{"artifact": r["artifact"], "why": _unranked_why(r)} for r in unranked],
    }
    out["sentence"] = _sentence(choice, runner, figure, decided_by, slo, served, unranked)
    return out


def _unranked_why(r: dict) -> str:
    if r["servable"] is False:
        return r.get("bench_note") or "not servable on this machine"
    if not r["benchmarked"]:
        return "not benchmarked"
    return "no figure to rank it by"


def separation(a: dict, b: dict | None, decided_by: str, figure: str) -> list[dict]:
    """Figure by figure, the choice against the runner-up, with intervals; `decides` marks what decided."""
    bp_a, bp_b = a.get("best_point") or {}, (b or {}).get("best_point") or {}
    rows = [
        (
            "goodput",
            "goodput at the SLO (req/s)",
            a.get("goodput"),
            (b or {}).get("goodput"),
            interval(a, "goodput"),
            interval(b or {}, "goodput"),
        ),
        (
            "throughput_tok_s",
            "throughput (tok/s)",
            a.get("throughput_tok_s"),
            (b or {}).get("throughput_tok_s"),
            None,
            None,
        ),
        (
            "recovery",
            f"accuracy recovery ({a.get('worst_task') or 'worst task'})",
            a.get("recovery"),
            (b or {}).get("recovery"),
            interval(a, "recovery"),
            interval(b or {}, "recovery"),
        ),
        (
            "kl_mean",
            "KL vs baseline",
            a.get("kl_mean"),
            (b or {}).get("kl_mean"),
            interval(a, "kl_mean"),
            interval(b or {}, "kl_mean"),
        ),
        (
            "top1_agreement",
            "top-1 agreement",
            a.get("top1_agreement"),
            (b or {}).get("top1_agreement"),
            interval(a, "top1_agreement"),
            interval(b or {}, "top1_agreement"),
        ),
        ("ttft_p99_ms", "TTFT p99 at that point (ms)", bp_a.get("ttft_p99_ms"), bp_b.get("ttft_p99_ms"), None, None),
        ("tpot_p99_ms", "TPOT p99 at that point (ms)", bp_a.get("tpot_p99_ms"), bp_b.get("tpot_p99_ms"), None, None),
        ("size_bytes", "size", a.get("size_bytes"), (b or {}).get("size_bytes"), None, None),
    ]
    if decided_by == "fidelity":
        kl_tie = b is not None and (
            a.get("kl_mean") == b.get("kl_mean")
            or (ties(a, b, "kl_mean") and bool(interval(a, "kl_mean") or interval(b, "kl_mean")))
        )
        decisive = "top1_agreement" if kl_tie else "kl_mean"
    else:
        decisive = {"size": "size_bytes"}.get(decided_by, figure)
    out = []
    for key, label, va, vb, ca, cb in rows:
        if va is None and vb is None:
            continue
        out.append(
            {
                "figure": key,
                "label": label,
                "choice": va,
                "runner_up": vb,
                "choice_ci": list(ca) if ca else None,
                "runner_up_ci": list(cb) if cb else None,
                "decides": key == decisive,
                "tied": key == figure and b is not None and ties(a, b, figure),
            }
        )
    return out


def _with_ci(r: dict, figure: str) -> str:
    v = r.get(figure)
    if v is None:
        return "—"
    ci = interval(r, figure)
    if figure == "recovery":
        return f"{v:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")
    return sig(v) + (f" [{sig(ci[0])}, {sig(ci[1])}]" if ci else "")


def _fid(r: dict, figure: str) -> str:
    ci = interval(r, figure)
    v = sig(r.get(figure), 2) if figure == "kl_mean" else fmt(r.get(figure))
    return v + (
        f" [{sig(ci[0], 2)}, {sig(ci[1], 2)}]"
        if ci and figure == "kl_mean"
        else f" [{fmt(ci[0])}, {fmt(ci[1])}]"
        if ci
        else ""
    )


def _sentence(c: dict, r: dict | None, figure: str, decided_by: str, slo: dict, served: list, unranked: list) -> str:
    slo_txt = slo_text(slo)
    unit = FIGURES[figure][1]
    b = c.get("best") or {}
    where = f" at concurrency {b['concurrency']}" if figure == "goodput" and b.get("concurrency") is not None else ""
    where += (
        f" with engine variant `{b['variant']}`"
        if figure == "goodput" and b.get("variant") and b["variant"] != "default"
        else ""
    )
    if figure == "goodput" and b.get("search"):
        where += " (the highest concurrency within the SLO, found by the goodput search)"
    elif figure == "goodput" and c.get("goodput_searched"):  # its probes failed the SLO or served less than this point
        where += " (the best of the measured concurrencies: the goodput search found no higher goodput within the SLO)"
    elif (
        figure == "goodput"
    ):  # vLLM's goodput at the sweep's best point: no search for the highest load meeting the SLO ran
        where += " (the best of the measured concurrencies: no goodput search ran)"
    mine = _with_ci(c, figure) + (f" {unit}" if unit else "")
    band = (
        "within the interval of"
        if (r is None or interval(c, figure) or interval(r, figure))
        else "within 10% (the run-to-run noise) of"
    )
    if figure == "goodput":
        head = f"it passes every gate and serves the most requests within the SLO ({slo_txt}), {mine}{where}"
        tie_head = f"it passes every gate, and its goodput within the SLO ({slo_txt}), {mine}{where},"
    elif figure == "throughput_tok_s":
        if not slo:
            why = "the recipe sets no SLO, so the highest throughput decides"
        elif any(x["goodput"] is not None for x in served):
            why = f"no passing artifact meets the SLO ({slo_txt}) at any measured concurrency, so the highest throughput decides"
        else:
            why = "no goodput at the SLO was measured, so the highest throughput decides"
        head = f"it passes every gate, and {why}: {mine}"
        tie_head = f"it passes every gate, and {why}; its {mine}"
    else:
        here = " on this machine" if any(x["servable"] is False for x in unranked) else ""
        head = (
            f"it passes every gate; no serving benchmark ranks the passing artifacts{here}, so accuracy decides: "
            f"recovery {mine} (worst task)"
        )
        tie_head = (
            f"it passes every gate; no serving benchmark ranks the passing artifacts{here}, and its accuracy recovery, "
            f"{mine},"
        )
    if r is None:
        text = head
    elif decided_by == figure:
        text = f"{head}, against {_with_ci(r, figure)}{' ' + unit if unit else ''} for the runner-up `{r['artifact']}`"
    elif decided_by == "fidelity":
        by_kl = next(x for x in separation(c, r, decided_by, figure) if x["decides"])["figure"] == "kl_mean"
        if by_kl:
            fid = (
                f"it is closer to the baseline (KL {_fid(c, 'kl_mean')} against {_fid(r, 'kl_mean')})"
                if r.get("kl_mean") is not None
                else f"only it has fidelity figures (KL {_fid(c, 'kl_mean')})"
            )
        else:
            fid = f"it agrees more often with the baseline's top token ({_fid(c, 'top1_agreement')} against {_fid(r, 'top1_agreement')})"
        text = f"{tie_head} is {band} `{r['artifact']}`'s {_with_ci(r, figure)}, so fidelity decides: {fid}"
    else:
        same = "their fidelity is the same"
        if interval(c, "kl_mean") or interval(r, "kl_mean"):  # equal within the evaluate stage's intervals, not equal
            same += f" within its 95% intervals (KL {_fid(c, 'kl_mean')} against {_fid(r, 'kl_mean')})"
        text = (
            f"{tie_head} is {band} `{r['artifact']}`'s {_with_ci(r, figure)} and {same}, "
            f"so the smaller one is chosen ({human_bytes(c['size_bytes'])} against {human_bytes(r['size_bytes'])})"
        )
    if unranked:
        names = ", ".join(f"`{x['artifact']}`" for x in unranked)
        one = len(unranked) == 1
        how = (
            "could not be served on this machine"
            if all(x["servable"] is False for x in unranked)
            else "were not benchmarked"
        )
        text += f" ({names} also pass{'es' if one else ''} every gate but {how.replace('were', 'was') if one else how})"
    return f"Recommended: `{c['artifact']}`: {text}."
