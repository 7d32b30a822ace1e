"""Release gates: an artifact's evaluation figures against the recipe's `evaluation.gates`. Light (no heavy imports), so
the runner, the package stage and the report all apply the same rule."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..recipe import Gates


def check_gates(gates: Gates, metrics: dict) -> list[str]:
    """Sentences naming each gate the metrics fail; [] when all pass (and for the baseline itself). A gate is checked on
    the 95% interval's bound, so an artifact passes only when the whole interval is on the right side: recovery's lower
    bound (paired bootstrap), the KL's upper and the top-1 agreement's lower bound (bootstrap over windows); without an
    interval the estimate is compared, and a failure says so. min_recovery covers every compared task metric (validation
    included) unless min_recovery_per_task names the task. A gate that cannot be checked (no comparison, recovery undefined
    because the baseline scored 0, no fidelity figures) fails: a release gate must not pass by default."""
    if not metrics or metrics.get("artifact") in (None, "baseline"):
        return []
    failures: list[str] = []
    comparison = metrics.get("comparison") or []
    per_task = dict(gates.min_recovery_per_task or {})
    if gates.min_recovery is not None or per_task:
        seen = {c["task"] for c in comparison}
        for task in sorted(set(per_task) - seen):
            failures.append(
                f"min_recovery_per_task names {task!r}, which was not evaluated (evaluated: {', '.join(sorted(seen)) or 'nothing'}); "
                "fix the task name or add the task to evaluation.lm_eval.tasks"
            )
        for c in comparison:
            floor = per_task.get(c["task"], gates.min_recovery)
            if floor is None:
                continue
            gate = "min_recovery_per_task" if c["task"] in per_task else "min_recovery"
            r = c.get("recovery")
            if r is None:
                failures.append(
                    f"{c['task']} {c['metric']} recovery is undefined (baseline {_fmt(c.get('baseline'))}, artifact "
                    f"{_fmt(c.get('artifact'))}), so {gate} {floor:g} cannot be checked; use a task the baseline scores on"
                )
                continue
            fail = _bound_fails(
                f"{c['task']} {c['metric']} recovery", r, c.get("ci95"), f"n={c.get('n')}", "lower", gate, floor, ".3f"
            )
            if fail:
                failures.append(fail)
    fid = metrics.get("fidelity") or {}
    for gate, key, side in (("max_kl", "kl_mean", "upper"), ("min_top1_agreement", "top1_agreement", "lower")):
        lim = getattr(gates, gate)
        if lim is None:
            continue
        value = fid.get(key)
        if value is None:
            failures.append(
                f"{gate} {lim:g} cannot be checked: no fidelity figures (they need evaluation.fidelity documents or "
                "evaluation.validation references)"
            )
            continue
        where = (
            f"{fid['n_windows']} {'validation rows' if fid.get('source') == 'validation' else 'windows'}"
            if fid.get("n_windows")
            else ""
        )
        fail = _bound_fails(key, value, fid.get(f"{key}_ci95"), where, side, gate, lim, ".4g")
        if fail:
            failures.append(fail)
    return failures


def _bound_fails(
    figure: str, value: float, ci, n_text: str, side: str, gate: str, limit: float, spec: str
) -> str | None:
    """The failure sentence of a gate on the interval's `side` bound ("lower": at least `limit`), or on the estimate
    where there is no interval; None when it passes."""

    def worse(v: float) -> bool:
        return v > limit if side == "upper" else v < limit

    rel = "above" if side == "upper" else "below"
    if not (isinstance(ci, (list, tuple)) and len(ci) == 2 and None not in ci):
        return (
            f"{figure} {value:{spec}} is {rel} {gate} {limit:g} (no interval was measured, so the estimate is compared)"
            if worse(value)
            else None
        )
    bound = ci[1] if side == "upper" else ci[0]
    if not (worse(bound) or worse(value)):
        return None
    what = (
        f"the {side} bound" if worse(bound) else "the estimate"
    )  # the estimate itself outside: an interval that does not bracket it
    ci_text = f"95% CI {ci[0]:{spec}}-{ci[1]:{spec}}" + (f", {n_text}" if n_text else "")
    return f"{figure} {value:{spec}} ({ci_text}): {what} is {rel} {gate} {limit:g}"


def _fmt(v) -> str:
    return "n/a" if v is None else f"{v:.4g}"
