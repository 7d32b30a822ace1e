"""The run record (run.json) as pydantic models: the runner writes it (atomically, secrets redacted, indexed in
runs/index.jsonl, runs that died unclosed marked killed); the report, compare, history and tracking read it back
through the same models, leniently (common/lenient.py: a damaged part reads as missing). A stage's `metrics` is the
stage's own output; report/records.py reads the parts the report uses.

    record = RunRecord.read(Path("runs/20261205-190123-9858/run.json"))
    record.stage("evaluate:int8").status      # "ok"
    record.metrics("quantize:int8")["size_bytes"]
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from pydantic import Field

from ..common.lenient import Flag, Lenient, Num, Obj, Part, PartsByName, Seq, Text, Texts
from .process import redact

log = logging.getLogger(__name__)
STAGE_OK = "ok"
RUN_DONE = ("ok", "gate_failed")  # statuses of a run that went to its end


class StageRecord(Lenient):
    """One stage of the run: reused or built (`cache`), and how it ended (`status`: ok, failed, skipped, interrupted)."""

    kind: Text = None
    artifact: Text = None
    env: Text = None
    key: Text = None
    cache: Text = None
    status: Text = None
    reason: Text = None
    error: Text = None
    fault: Flag = None  # failed for a reason of the host (out of memory, a killed server), not of its input: retried
    retried: Text = None  # the failure of an earlier try in this run, which it was tried again after
    log: Text = None
    log_tail: Text = None
    wall_s: Num = None
    stage_wall_s: Num = None
    metrics: Obj = Field(default_factory=dict)
    out: Text = None
    placement: Obj = Field(default_factory=dict)
    devices: Texts = Field(default_factory=list)
    start_s: Num = None
    end_s: Num = None
    measured_s: Seq = Field(default_factory=list)  # [[start, end], ...]: when a shared benchmark had its GPU alone
    preflight: Obj = Field(default_factory=dict)


class ArtifactRecord(Lenient):
    """An artifact's outcome: its stages' statuses, its gate verdict, where its package was published."""

    method: Text = None
    stages: Obj = Field(default_factory=dict)
    gate: Text = None
    gate_failures: Texts = Field(default_factory=list)
    package: Text = None
    package_error: Text = None


class Provenance(Lenient):
    version: Text = None
    git_commit: Text = None


class Hardware(Lenient):
    machine: Text = None
    system: Text = None
    cpus: Num = None
    python: Text = None
    cpu: Text = None
    mem_gib: Num = None
    gpus: Texts = Field(default_factory=list)


class RunRecord(Lenient):
    """A run: the recipe as run, the machine and library versions, every stage, every artifact, the outcome."""

    run_id: Text = None
    recipe_name: Text = None
    recipe_path: Text = None
    recipe_hash: Text = None
    command: Text = None  # the command line that started the run, as typed (secrets redacted with the rest)
    recipe: Obj = Field(default_factory=dict)  # the recipe as validated (recipe/schema.py), in JSON form
    status: Text = None
    error: Text = None
    started_at: Text = None
    quantpipe: Part(Provenance) = Field(default_factory=Provenance)
    versions: Obj = Field(default_factory=dict)  # environment -> {library: version}
    hardware: Part(Hardware) = Field(default_factory=Hardware)
    cache_dir: Text = None
    stages: PartsByName(StageRecord) = Field(default_factory=dict)
    artifacts: PartsByName(ArtifactRecord) = Field(default_factory=dict)
    available: Obj = Field(default_factory=dict)
    scheduler: Obj = Field(default_factory=dict)
    report: Texts = Field(default_factory=list)
    report_error: Text = None
    finished_at: Text = None
    wall_s: Num = None

    @classmethod
    def of(cls, record: RunRecord | dict) -> RunRecord:
        """A record as read from run.json (a dict) or already a model."""
        return (
            record if isinstance(record, RunRecord) else cls.model_validate(record if isinstance(record, dict) else {})
        )

    @staticmethod
    def is_record(raw) -> bool:
        """JSON read from a run.json is a run record: an object whose `stages` is an object, as quantpipe writes it."""
        return isinstance(raw, dict) and isinstance(raw.get("stages"), dict)

    @classmethod
    def read(cls, path: Path) -> RunRecord:
        """run.json read back; OSError / ValueError when the file is missing or not JSON."""
        return cls.of(json.loads(Path(path).read_text()))

    def stage(self, step: str) -> StageRecord:
        """The stage's record, or an empty one where the run did not record it."""
        return self.stages.get(step) or StageRecord()

    def metrics(self, step: str) -> dict:
        """The stage's metrics where it completed (`status` ok), else {}."""
        st = self.stage(step)
        return st.metrics if st.status == STAGE_OK else {}

    def artifact(self, name: str) -> ArtifactRecord:
        return self.artifacts.get(name) or ArtifactRecord()

    def to_json(self) -> dict:
        """What run.json holds: every field the runner set or filled, nothing left at an empty default."""
        return self.model_dump(mode="json")


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


def write_record(run_dir: Path, record: RunRecord, secret_values: list[str]) -> None:
    tmp = run_dir / ".run.json.tmp"
    tmp.write_text(redact(json.dumps(record.to_json(), indent=2, default=str), secret_values))
    os.replace(tmp, run_dir / "run.json")


def index_run(out_dir: Path, record: RunRecord, run_dir: Path) -> None:
    line = {
        k: getattr(record, k) for k in ("run_id", "recipe_name", "recipe_hash", "started_at", "finished_at", "status")
    }
    line["run_dir"] = str(run_dir)
    with open(out_dir / "runs" / "index.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")


def close_dead_runs(out_dir: Path, this_run: Path, secret_values: list[str]) -> None:
    """Mark other runs' "running" records killed and index them: this run holds the output lock, so those runs died."""
    for path in sorted((out_dir / "runs").glob("*/run.json")):
        if path.parent == this_run:
            continue
        try:
            rec = RunRecord.read(path)
        except (OSError, ValueError):
            continue
        if rec.status == "running":
            rec.status = "killed"
            rec.error = f"the run ended without closing its record (killed, or the machine went down); found by run {this_run.name}"
            write_record(path.parent, rec, secret_values)
            index_run(out_dir, rec, path.parent)
            log.warning("run %s was killed before it finished; its committed stages stay cached", rec.run_id)
