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

from .compare import CompareError, compare_runs
from .render import write_report
from .summary import summarize

__all__ = ["CompareError", "compare_runs", "summarize", "write_report"]
