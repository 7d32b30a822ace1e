"""Release gates: an artifact's evaluation figures against the recipe's `evaluation.gates`.

Light (no heavy imports): the runner, the package stage and the report all apply the same rule.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..recipe import Gates


def check_gates(gates: Gates, metrics: dict) -> list[str]:
    """Sentences naming each gate the metrics fail; [] when all pass (and for the baseline itself).

    min_recovery applies to every compared task metric (validation included); an entry of
    min_recovery_per_task replaces it for that task. A gate that cannot be checked (no comparison,
    recovery undefined because the baseline scored 0, no fidelity figures) fails: a release gate
    must not pass by default.
    """
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
            elif r < floor:
                ci = c.get("ci95")
                ci_txt = f" (95% CI {ci[0]:.3f}-{ci[1]:.3f}, n={c.get('n')})" if ci and None not in ci else ""
                failures.append(f"{c['task']} {c['metric']} recovery {r:.3f}{ci_txt} < {gate} {floor:g}")
    fid = metrics.get("fidelity")
    for gate, key, worse in (("max_kl", "kl_mean", lambda v, lim: v > lim), ("min_top1_agreement", "top1_agreement", lambda v, lim: v < lim)):
        lim = getattr(gates, gate)
        if lim is None:
            continue
        value = (fid or {}).get(key)
        if value is None:
            failures.append(f"{gate} {lim:g} cannot be checked: no fidelity figures (they need evaluation.validation prompts)")
        elif worse(value, lim):
            failures.append(f"{key} {value:.4g} {'>' if gate == 'max_kl' else '<'} {gate} {lim:g}")
    return failures


def _fmt(v) -> str:
    return "n/a" if v is None else f"{v:.4g}"
