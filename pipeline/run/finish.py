"""The end of a run: each artifact's gates, its package published, the report, the run's status.

finish_run(recipe, out_dir, record, steps, failed, run_dir, say)   # PublishError: the output folder is not ours to write
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from .publish import publish
from .record import ArtifactRecord, RunRecord

log = logging.getLogger("quantpipe.run.runner")


def finish_run(recipe, out_dir: Path, record: RunRecord, steps: list, failed: dict, run_dir: Path, say) -> None:
    """Gates per artifact, the packages published, the report written, the run's status set (`say` prints a line)."""
    from ..common.gates import check_gates

    gates = recipe.evaluation.gates
    any_gate_failed = False
    for a in recipe.artifacts:
        ids = [s.id for s in steps if s.artifact == a.name]
        if not ids:
            continue
        art = ArtifactRecord(method=a.method, stages={i: record.stages[i].status for i in ids})
        ev = record.stage(f"evaluate:{a.name}")
        if ev.status == "ok":
            failures = check_gates(gates, ev.metrics)
            art.gate = "FAIL" if failures else "PASS"
            art.gate_failures = failures
            any_gate_failed |= bool(failures)
        else:
            art.gate = "NOT RUN"
        pkg = record.stage(f"package:{a.name}")
        if pkg.status == "ok":
            try:
                art.package = str(publish(out_dir, a.name, Path(pkg.out), pkg.key))
            except OSError as e:  # a full or read-only output disk: the package stays cached, nothing half-published
                why = (
                    e.args[0][0][2] if isinstance(e, shutil.Error) and e.args and e.args[0] else str(e)
                )  # copytree: (src, dst, why) per file
                art.package_error = f"could not publish the package to {out_dir / 'packages' / a.name}: {why}"
                failed[f"publish:{a.name}"] = art.package_error
                say(f"  [red]x[/red] {'publish:' + a.name:<24} FAILED: {plain(art.package_error)}")
        record.artifacts[a.name] = art
    record.status = "failed" if failed else ("gate_failed" if any_gate_failed else "ok")
    try:
        from ..report import write_report

        record.report = [str(p) for p in write_report(record, run_dir, out_dir)]  # the CLI's summary names it
    except Exception as e:  # a report bug must not hide the run's results
        log.exception("report failed")
        record.report_error = f"{type(e).__name__}: {e}"
        record.status = "failed"
    for a, art in record.artifacts.items():  # the console shows the gates in its summary table (quantpipe.console)
        log.info("%s gate %s %s", a, art.gate, "; ".join(art.gate_failures))
    if failed:
        say(f"[red]{len(failed)} stage(s) did not complete:[/red] " + ", ".join(sorted(failed)))


def plain(text: str) -> str:
    """Text from a stage or the disk, for the console: brackets in it are not rich markup."""
    from rich.markup import escape

    return escape(text)
