"""The parts of a run record (run/record.py) the report reads, as lenient models (common/lenient.py): each stage's
metrics where it completed, the recipe's workload, SLO and gates. A malformed part reads as missing, so one damaged
field cannot sink the report or a comparison.

    ev = EvaluateFigures.of(record, "evaluate:int8")
    [(c.task, c.recovery) for c in ev.comparison]     # [("arc_easy", 0.99), ...]
"""

from __future__ import annotations

import math
from pathlib import Path

from pydantic import Field

from ..common.lenient import (
    Flag,
    Int,
    Lenient,
    Num,
    Obj,
    Pair,
    Part,
    Parts,
    PartsByName,
    Seq,
    Text,
    Texts,
    number,
    pair,
)
from ..run.record import RunRecord

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"
LATENCY_THRESHOLD = 0.10  # relative change of a latency/throughput figure treated as run-to-run noise (CPU runs vary)
MIN_ABS_MS = 2.0  # a latency change below this many ms is timer/scheduler jitter, whatever its ratio


class CompareError(Exception):
    """Runs that cannot be compared (missing, unreadable, no last good run); the message says what to do."""


class StageFigures(Lenient):
    """A stage's metrics, read from the record where the stage completed (else every field empty)."""

    @classmethod
    def of(cls, record: RunRecord, step: str):
        return cls.model_validate(record.metrics(step))


class QuantizeFigures(StageFigures):
    method: Text = None
    scheme: Text = None
    size_bytes: Num = None
    baseline_size_bytes: Num = None
    compression: Num = None


class Comparison(Lenient):
    """One task/metric of an artifact against the baseline (the evaluate stage's `comparison` rows)."""

    task: Text = None
    metric: Text = None
    artifact: Num = None
    baseline: Num = None
    recovery: Num = None
    ci95: Pair = None
    n: Int = None
    flip_rate: Num = None

    def halfwidth(self) -> float | None:
        """Half-width of the 95% CI in recovery units: the CI is on the recovery if it brackets it, else on the score;
        without a CI, a binomial one on the score (floored so that a perfect score still has a width)."""
        ci, base = self.ci95, self.baseline
        if ci is None:
            n, p = self.n, self.artifact
            if n is not None and n > 0 and p is not None and 0 <= p <= 1 and base:
                return 1.96 * math.sqrt(max(p * (1 - p), 1 / n) / n) / base
            return None
        hw = (ci[1] - ci[0]) / 2
        if self._ci_on_recovery():
            return hw
        return hw / base if base else None

    def recovery_interval(self) -> list[float] | None:
        """The 95% interval on the recovery: as recorded when it brackets the recovery, else ± `halfwidth()`."""
        hw = self.halfwidth()
        if self.recovery is None or hw is None:
            return None
        if self._ci_on_recovery():
            return list(self.ci95)
        return [self.recovery - hw, self.recovery + hw]

    def _ci_on_recovery(self) -> bool:
        """The recorded CI brackets the recovery, so it is an interval on the recovery (else on the score)."""
        ci, rec = self.ci95, self.recovery
        return ci is not None and rec is not None and ci[0] - 1e-9 <= rec <= ci[1] + 1e-9


class Fidelity(Lenient):
    kl_mean: Num = None
    kl_mean_ci95: Pair = None
    top1_agreement: Num = None
    top1_agreement_ci95: Pair = None
    ppl: Num = None
    ppl_ci95: Pair = None
    ppl_baseline: Num = None
    ppl_ratio: Num = None
    ppl_ratio_ci95: Pair = None
    n_tokens: Int = None
    n_windows: Int = None
    source: Text = None
    ci_method: Text = None
    kl_support: Text = None


class Validation(Lenient):
    score: Num = None
    metric: Text = None
    n: Int = None
    timed_out: Texts = Field(default_factory=list)  # file:line of rows whose pattern ran past the limit (scored 0)


class EvaluateFigures(StageFigures):
    comparison: Parts(Comparison) = Field(default_factory=list)
    validation: Part(Validation) | None = None
    fidelity: Part(Fidelity) = Field(default_factory=Fidelity)


class Percentiles(Lenient):
    mean: Num = None
    p50: Num = None
    p90: Num = None
    p99: Num = None
    p50_ci95: Pair = None
    p99_ci95: Pair = None

    def p50_or_mean(self) -> float | None:
        """The p50, or the mean where the run recorded no p50."""
        return self.p50 if self.p50 is not None else self.mean


class ServeResult(Lenient):
    """One measured point of the served sweep (variant × workload × concurrency), or a goodput-search probe."""

    variant: Text = None
    workload: Text = None
    concurrency: Int = None
    output_throughput: Num = None
    request_throughput: Num = None
    goodput: Num = None
    goodput_ci95: Pair = None
    ttft_ms: Part(Percentiles) = Field(default_factory=Percentiles)
    tpot_ms: Part(Percentiles) = Field(default_factory=Percentiles)
    e2el_ms: Part(Percentiles) = Field(default_factory=Percentiles)
    ci95: Obj = Field(default_factory=dict)  # figure -> [lo, hi]
    intervals: Obj = Field(default_factory=dict)
    starts: Seq = Field(default_factory=list)  # with benchmark.server_starts: each start's own figures

    def interval(self, key: str) -> list[float] | None:
        """A 95% interval of `key`, where the row records one (`<key>_ci95`, `ci95: {key: …}` or `intervals: {key: …}`)."""
        for ci in (getattr(self, f"{key}_ci95", None), self.ci95.get(key), self.intervals.get(key)):
            ci = pair(ci)
            if ci and ci[0] <= ci[1]:
                return ci
        return None


class Best(Lenient):
    variant: Text = None
    concurrency: Int = None
    goodput: Num = None
    goodput_ci95: Pair = None
    search: Flag = None


class Offline(Lenient):
    latency_s_batch1: Num = None
    throughput_tok_s: Num = None


class GoodputSearch(Lenient):
    probed: Seq = Field(default_factory=list)
    rows: Parts(ServeResult) = Field(default_factory=list)


class LoraComparison(Lenient):
    workload: Text = None
    concurrency: Int = None
    output_throughput_ratio: Num = None
    ttft_p50_ratio: Num = None
    tpot_p50_ratio: Num = None


class Lora(Lenient):
    servable: Flag = None
    reason: Text = None
    comparison: Parts(LoraComparison) = Field(default_factory=list)


class Variant(Lenient):
    log: Text = None
    kernels: Obj = Field(default_factory=dict)


class BenchmarkFigures(StageFigures):
    servable: Flag = None
    reason: Text = None
    status_note: Text = None
    platform: Text = None
    kernels: Obj = Field(default_factory=dict)
    variants: PartsByName(Variant) = Field(default_factory=dict)
    server_start_s: Num = None
    startup: Obj = Field(default_factory=dict)
    results: Parts(ServeResult) = Field(default_factory=list)
    best: Part(Best) = Field(default_factory=Best)
    offline: Part(Offline) = Field(default_factory=Offline)
    goodput_search: Part(GoodputSearch) = Field(default_factory=GoodputSearch)
    lora: Part(Lora) | None = None

    def best_row(self) -> ServeResult | None:
        """The result row of the best point (its variant and concurrency, or the goodput search's probe)."""
        b = self.best
        if b.concurrency is None:
            return None
        found = self.goodput_search.rows if b.search else self.results
        return next((r for r in found if r.concurrency == b.concurrency and (b.search or r.variant == b.variant)), None)


class RecipeArtifact(Lenient):
    name: Text = None
    method: Text = None


class RecipeFacts(Lenient):
    """What the report reads of the recipe as run: artifacts' methods, the first workload, the SLO, the gates."""

    notes: Text = None
    artifacts: Parts(RecipeArtifact) = Field(default_factory=list)
    benchmark: Obj = Field(default_factory=dict)
    evaluation: Obj = Field(default_factory=dict)
    base: Obj = Field(default_factory=dict)

    @classmethod
    def of(cls, record: RunRecord) -> RecipeFacts:
        return cls.model_validate(record.recipe)

    def methods(self) -> dict[str, str | None]:
        return {a.name: a.method for a in self.artifacts}

    def workload(self) -> dict:
        wl = self.benchmark.get("workloads")
        return wl[0] if isinstance(wl, list) and wl and isinstance(wl[0], dict) else {}

    def slo(self) -> dict[str, float]:
        slo = self.benchmark.get("slo")
        return {k: v for k, v in slo.items() if number(v) is not None} if isinstance(slo, dict) else {}

    def server_starts(self) -> int:
        """How many server starts each served figure pools (`benchmark.server_starts`)."""
        n = self.benchmark.get("server_starts")
        return n if isinstance(n, int) and n > 1 else 1

    def gates(self) -> dict:
        g = self.evaluation.get("gates")
        return g if isinstance(g, dict) else {}


def artifact_names(record: RunRecord) -> list[str]:
    """The artifacts the run built, in the recipe's order, then any other the record has; a record that names none (a
    run stopped before its end) reads as the recipe's. A run narrowed by `--artifacts` names only those."""
    names = [n for n in RecipeFacts.of(record).methods() if n and (n in record.artifacts or not record.artifacts)]
    names += [n for n in record.artifacts if n not in names]
    return list(dict.fromkeys(names))


def serve_rows(bench: BenchmarkFigures, workload: str | None) -> tuple[str | None, dict[int, ServeResult]]:
    """(variant, {concurrency: result}) of the benchmark's best variant (else the first measured) on `workload`."""
    if not bench.results:
        return None, {}
    variants = list(dict.fromkeys(r.variant for r in bench.results))
    variant = bench.best.variant if bench.best.variant in variants else variants[0]
    workloads = list(dict.fromkeys(r.workload for r in bench.results if r.variant == variant))
    wl = workload if workload in workloads else workloads[0]
    rows = {r.concurrency: r for r in bench.results if r.variant == variant and r.workload == wl}
    rows.pop(None, None)
    return variant, rows


def accuracy_rows(ev: EvaluateFigures) -> list[dict]:
    """The evaluation's comparison rows as the report's plain data."""
    return [
        {
            "task": c.task,
            "metric": c.metric,
            "value": c.artifact,
            "baseline": c.baseline,
            "recovery": c.recovery,
            "ci95": c.ci95,
            "n": c.n,
            "flip_rate": c.flip_rate,
        }
        for c in ev.comparison
    ]
