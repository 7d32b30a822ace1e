"""The run record: run.json written atomically (secrets redacted), runs/index.jsonl, runs that died unclosed."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from .process import redact

log = logging.getLogger(__name__)


def new_run_dir(runs: Path, t_start: float) -> Path:
    """runs/<UTC start>-<pid>, made (with its logs/); a run of the same process in the same second gets a suffix."""
    import time

    stem = time.strftime("%Y%m%d-%H%M%S", time.gmtime(t_start)) + f"-{os.getpid()}"
    for n in range(1, 1000):
        d = runs / (stem if n == 1 else f"{stem}-{n}")
        try:
            (d / "logs").mkdir(parents=True)
            return d
        except FileExistsError:
            continue
    raise FileExistsError(f"{runs}: no free run directory for {stem}")


def write_record(run_dir: Path, record: dict, secret_values: list[str]) -> None:
    tmp = run_dir / ".run.json.tmp"
    tmp.write_text(redact(json.dumps(record, indent=2, default=str), secret_values))
    os.replace(tmp, run_dir / "run.json")


def index_run(out_dir: Path, record: dict, run_dir: Path) -> None:
    line = {k: record.get(k) for k in ("run_id", "recipe_name", "recipe_hash", "started_at", "finished_at", "status")}
    line["run_dir"] = str(run_dir)
    with open(out_dir / "runs" / "index.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")


def close_dead_runs(out_dir: Path, this_run: Path, secret_values: list[str]) -> None:
    """Mark other runs' "running" records killed and index them: this run holds the output lock, so those runs died."""
    for path in sorted((out_dir / "runs").glob("*/run.json")):
        if path.parent == this_run:
            continue
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if rec.get("status") == "running":
            rec["status"] = "killed"
            rec["error"] = (
                f"the run ended without closing its record (killed, or the machine went down); found by run {this_run.name}"
            )
            write_record(path.parent, rec, secret_values)
            index_run(out_dir, rec, path.parent)
            log.warning("run %s was killed before it finished; its committed stages stay cached", rec.get("run_id"))
