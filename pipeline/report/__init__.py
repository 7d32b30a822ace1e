"""The run report and run-to-run comparison. `write_report` turns a run's record (run.json) into report.html
(self-contained: plots embedded as PNG, no network), report.md (plots under plots/) and report.json: every artifact
against the baseline, accuracy-vs-speed plots with the Pareto front, a recommendation, and how each figure was obtained.
`compare_runs` calls a change a regression only when it is larger than the noise (the accuracy CI, a latency threshold):

    quantpipe compare out/demo/runs/20261130-061500-123 --against last-good
"""

from .compare import CompareError, compare_runs
from .render import write_report
from .summary import summarize

__all__ = ["CompareError", "compare_runs", "summarize", "write_report"]
