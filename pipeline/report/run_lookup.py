"""Finding the runs that `quantpipe compare` and `--against last-good` put side by side: a run's record from its
directory or its run.json, and the most recent good run of the same recipe from the output directory's runs/index.jsonl.
Each refusal is a `CompareError` that says which path to give instead.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..run.record import RunRecord
from .records import CompareError


def load_run(path: Path) -> tuple[RunRecord, Path]:
    """(run record, run directory) from a run directory or a run.json path."""
    p = Path(path)
    f = p / "run.json" if p.is_dir() else p
    if not f.is_file():
        raise CompareError(
            f"{path}: no run.json there; give a run directory (<output_dir>/runs/<run_id>) or its run.json"
        )
    try:
        record = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise CompareError(
            f"{f}: not JSON ({e}), so not a run record (or a damaged one); give a run directory "
            "(<output_dir>/runs/<run_id>) or its run.json"
        ) from None
    if not RunRecord.is_record(record):
        raise CompareError(
            f"{f}: not a quantpipe run record (no `stages` object); give a run.json that `quantpipe run` wrote"
        )
    return RunRecord.of(record), f.parent


def last_good(run_dir: Path, record: RunRecord) -> Path:
    """The most recent run of the same recipe before this one with status ok, from runs/index.jsonl."""
    index = run_dir.parent / "index.jsonl"
    if not index.is_file():
        raise CompareError(
            f"{index}: no run index; --against last-good needs runs recorded by `quantpipe run` in the same output directory"
        )
    entries = []
    for line in index.read_text().splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash: skip it
        if isinstance(e, dict):
            entries.append(e)
    me, start = record.run_id, record.started_at or ""
    good = [
        e
        for e in entries
        if e.get("status") == "ok"
        and e.get("recipe_name") == record.recipe_name
        and e.get("run_id") != me
        and (e.get("started_at") or "") <= start
    ]
    for e in sorted(good, key=lambda e: (e.get("started_at") or "", e.get("run_id") or ""), reverse=True):
        d = Path(e.get("run_dir") or run_dir.parent / str(e.get("run_id")))
        if not d.is_absolute():
            d = run_dir.parent / d
        if (d / "run.json").is_file():
            return d
    raise CompareError(
        f"no earlier good run (status ok) of recipe {record.recipe_name!r} in {index}; "
        "nothing to compare against yet (the first good run becomes the reference)"
    )
