"""The paired comparison of an artifact with the baseline: recovery, its bootstrap 95% CI, the flip rate. Both were
scored on the same examples in the same order (`Scores.ids` says which; a difference is refused), so each bootstrap draw
takes the same examples from both, and the CI is that of the ratio on the examples themselves, tight where the two agree.

    from quantpipe.stages.evaluate import compare
    compare([1, 0, 1, 1], [1, 0, 0, 1], samples=1000)   # {"recovery": 0.667, "ci95": [...], "flip_rate": 0.25, ...}
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import StageError

BOOTSTRAP_SEED = 0


@dataclass
class Scores:
    """What per_example.json holds: per-example scores by `task/metric` (in doc order), example ids by task,
    and whether higher is better for each lm-eval metric."""

    per_example: dict[str, list[float]] = field(default_factory=dict)
    ids: dict[str, list[str]] = field(default_factory=dict)
    higher: dict[str, bool] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"scores": self.per_example, "ids": self.ids, "higher_is_better": self.higher}


def compare(
    baseline: list[float],
    artifact: list[float],
    samples: int,
    higher_is_better: bool = True,
    seed: int = BOOTSTRAP_SEED,
) -> dict:
    """Recovery (artifact/baseline; baseline/artifact when lower is better) with a paired bootstrap 95% CI."""
    import numpy as np

    b, a = np.asarray(baseline, dtype=np.float64), np.asarray(artifact, dtype=np.float64)
    if b.shape != a.shape or b.ndim != 1 or len(b) == 0:
        raise ValueError(f"paired scores must be two equal-length non-empty lists, got {b.shape} and {a.shape}")
    n = len(b)
    mb, ma = float(b.mean()), float(a.mean())
    num, den = (ma, mb) if higher_is_better else (mb, ma)
    recovery = num / den if den != 0 else None
    ci = None
    if recovery is not None:
        rng = np.random.default_rng(seed)
        ratios = []
        chunk = max(1, min(samples, 20_000_000 // n))  # bound memory at ~160 MB of indices
        for start in range(0, samples, chunk):
            idx = rng.integers(0, n, size=(min(chunk, samples - start), n))
            rb, ra = b[idx].mean(axis=1), a[idx].mean(axis=1)
            top, bottom = (ra, rb) if higher_is_better else (rb, ra)
            with np.errstate(divide="ignore", invalid="ignore"):
                ratios.append(np.where(bottom != 0, top / np.where(bottom != 0, bottom, 1), np.nan))
        r = np.concatenate(ratios)
        r = r[np.isfinite(r)]
        if len(r):
            ci = [float(np.percentile(r, 2.5)), float(np.percentile(r, 97.5))]
    binary = bool(np.isin(b, (0.0, 1.0)).all() and np.isin(a, (0.0, 1.0)).all())
    return {
        "baseline": mb,
        "artifact": ma,
        "recovery": recovery,
        "ci95": ci,
        "flip_rate": float((b != a).mean()) if binary else None,
        "n": n,
    }


def compare_all(
    base: dict, scores: Scores, lm_metrics: dict | None, validation: dict | None, samples: int
) -> list[dict]:
    """Paired comparison per task and metric (per-example where scores are per-example means, else aggregate only);
    `base` is the baseline's evaluation.json with its per_example.json under `per_example`."""
    bpe = base["per_example"]
    for task, mine in scores.ids.items():
        theirs = bpe.get("ids", {}).get(task)
        if theirs != mine:
            raise StageError(
                f"{task}: the baseline was scored on different examples ({len(theirs or [])} vs {len(mine)}, or other documents); "
                "re-run evaluate:baseline with the same data (--force evaluate)"
            )
    per_example, higher = scores.per_example, scores.higher
    rows = []
    for task, m in (lm_metrics or {}).items():
        for name, value in m.items():
            if "_stderr" in name or not isinstance(value, (int, float)):
                continue
            key = f"{task}/{name}"
            bval = (base.get("lm_eval") or {}).get(task, {}).get(name)
            if (
                key in per_example
                and key in bpe["scores"]
                and _is_mean(per_example[key], value)
                and _is_mean(bpe["scores"][key], bval)
            ):
                c = compare(bpe["scores"][key], per_example[key], samples, higher.get(key, True))
            else:
                hib = higher.get(key, True)
                num, den = (value, bval) if hib else (bval, value)
                c = {
                    "baseline": bval,
                    "artifact": value,
                    "recovery": (num / den if bval is not None and den else None),
                    "ci95": None,
                    "flip_rate": None,
                    "n": None,
                }
            rows.append({"task": task, "metric": name, **c})
    if validation is not None:
        key = f"validation/{validation['metric']}"
        if key not in bpe["scores"]:
            raise StageError(
                "the baseline has no validation scores for this metric; re-run evaluate:baseline (--force evaluate)"
            )
        rows.append(
            {
                "task": "validation",
                "metric": validation["metric"],
                **compare(bpe["scores"][key], per_example[key], samples, True),
            }
        )
    return rows


def _is_mean(scores: list[float] | None, value) -> bool:
    return bool(scores) and value is not None and abs(sum(scores) / len(scores) - value) <= 1e-9 * max(1.0, abs(value))
