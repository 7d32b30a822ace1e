"""The runner: plans a recipe's stages once, reuses cached ones, runs the rest, records the run. Merge runs once;
the unquantized merged model is the `baseline`, evaluated and benchmarked like every artifact; then per artifact
quantize -> evaluate -> benchmark -> package. Each stage starts once its inputs are committed (run/dispatch.py) as
a `worker.py` subprocess in its environment (run/process.py), committed atomically to the stage cache (run/build.py);
under the vllm evaluation backend an artifact's evaluate and benchmark, when both need building, run as one job with
one server. A run writes `<output_dir>/runs/<run_id>/` (run.json, run.log, logs/, report.*) and publishes
`<output_dir>/packages/<artifact>`.

    quantpipe run recipes/demo.yaml --dry-run
"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
import time
from pathlib import Path

from filelock import FileLock, Timeout

from .. import __version__, deadline, preflight
from ..cache import ContentHasher, StageCache, hash_json
from ..common import measure_gate
from ..envs import LEGACY_ENVS, git_commit, hardware, python_for, versions
from ..recipe import Recipe
from ..stages.contract import Upstream
from .build import Builder
from .dispatch import RunError, StepDispatch, is_forced
from .finish import finish_run
from .hub import HubError, cache_root, resolve_base
from .plan import Step, build_steps, compute_keys, select
from .process import Processes, RedactFilter, redact, secrets
from .publish import PublishError, unpublished
from .record import RunRecord, close_dead_runs, index_run, new_run_dir, write_record
from .schedule import Scheduler, default_jobs, free_bytes, gpus

log = logging.getLogger(__name__)
KINDS = ("merge", "quantize", "evaluate", "benchmark", "package")
EXIT_FAILED, EXIT_GATE = 1, 3


class Runner(StepDispatch):
    def __init__(
        self,
        recipe: Recipe,
        recipe_path: Path,
        console=None,
        verbose: bool = False,
        stage_timeout_s: float | None = None,
        jobs: int | None = None,
        gpu_select: str | None = None,
        executor=None,
        gpu_memory_bytes: int | None = None,
        command: str | None = None,
    ):
        self.recipe = recipe
        self.recipe_path = Path(recipe_path)
        self.console = console
        self.stage_timeout_s = stage_timeout_s  # --stage-timeout: None gives each stage its default deadline, 0 none
        self.deadlines_s: dict[str, float | None] = {}  # stage id -> seconds it may run (quantpipe.deadline)
        self.cache = StageCache(cache_root(recipe))
        self.hasher = ContentHasher(cache_root(recipe) / "hashes.json")
        self.out_dir = Path(recipe.output_dir)
        self.secret_values = secrets()
        self.tmpdir = self.cache.root / "tmp"  # working folders of this runner and its stages (the cache's own)
        self.procs = Processes(self.tmpdir, self.secret_values, verbose)
        self.preflight_problems: list[str] = []  # what pre-flight would refuse (dry run)
        self.estimates: dict = {}  # stage id -> pre-flight estimate
        self.available: dict | None = None  # what pre-flight compared the estimates with
        self.records: dict[str, Upstream] = {}  # stage id -> its committed output, key, wall time and metrics
        self.run_dir: Path | None = None  # the last run's folder (the CLI prints its summary from there)
        self.gpu_memory_bytes = gpu_memory_bytes  # --gpu-memory: the most this run uses of each GPU
        self.command = command  # the command line that started the run, for its record and report
        self.gpus = gpus(gpu_select, gpu_memory_bytes)
        self.scheduler = Scheduler(self.gpus, jobs=jobs or default_jobs(len(self.gpus)), free_probe=free_bytes)
        self.builder = Builder(self)
        self.executor = (
            executor.attach(self) if executor is not None else None
        )  # --executor ray: its procs and scheduler replace these

    def say(self, msg: str) -> None:
        if self.console is not None:
            self.console.print(msg, highlight=False)
        log.info(re.sub(r"\[/?[a-z ]+\]", "", msg).replace("\\[", "["))

    def plan(self, dry_run: bool, kinds=None, artifacts=None) -> tuple[str, list[Step]]:
        if artifacts:
            unknown = set(artifacts) - {a.name for a in self.recipe.artifacts}
            if unknown:
                raise RunError(
                    f"--artifacts: no artifact named {', '.join(sorted(unknown))} in the recipe; it has {', '.join(a.name for a in self.recipe.artifacts)}"
                )
        try:
            base_dir = resolve_base(self.recipe, dry_run)
        except HubError as e:
            raise RunError(str(e)) from None
        steps = build_steps(self.recipe, base_dir)
        if dry_run and not self.recipe.base.is_local:
            for s in steps:
                s.key = "(after download)"
        else:
            compute_keys(steps, self.recipe, base_dir, self.hasher)
        steps = select(steps, kinds, artifacts)
        for env in sorted({s.env for s in steps} & set(LEGACY_ENVS.values())):
            python_for(env)  # an optional environment that is missing stops the plan, naming the command that builds it
        return base_dir, steps

    def deadline_s(self, sid: str) -> float | None:
        """The seconds stage `sid` may run before it is stopped (None: no deadline)."""
        if sid in self.deadlines_s:
            return self.deadlines_s[sid]
        return self.stage_timeout_s or (None if self.stage_timeout_s == 0 else deadline.UNKNOWN_DEADLINE_S)

    def _set_deadlines(self, steps, base_dir, gpu) -> None:
        self.deadlines_s = deadline.deadlines(
            deadline.estimate(self.recipe, steps, base_dir, gpu), steps, self.stage_timeout_s
        )

    def dry_run(self, force: set[str], kinds=None, artifacts=None) -> list[dict]:
        base_dir, steps = self.plan(dry_run=True, kinds=kinds, artifacts=artifacts)
        have = preflight.machine(self.cache.root, self.out_dir, self.gpu_memory_bytes)
        est = preflight.estimate(self.recipe, steps, base_dir, have["gpu"], have["ram_bytes"])
        self._set_deadlines(steps, base_dir, have["gpu"])
        rows = []
        for s in steps:
            state = "forced" if is_forced(s, force) else ("hit" if s.key and self.cache.lookup(s.id, s.key) else "miss")
            e = preflight.record(est, s.id) or {}
            rows.append(
                {
                    "stage": s.id,
                    "env": s.env,
                    "key": s.key[:12],
                    "cache": state,
                    "ram_gib": e.get("ram_gib"),
                    "gpu_gib": e.get("gpu_gib"),
                    "disk_gib": (e.get("disk_cache_gib", 0) + e.get("disk_output_gib", 0)) if e else None,
                    "deadline_s": self.deadline_s(s.id),
                }
            )
        self.preflight_problems = preflight.problems(
            self.recipe, est, have, {r["stage"] for r in rows if r["cache"] != "hit"}, unpublished(steps, self.out_dir)
        )
        return rows

    def run(self, force: set[str], kinds=None, artifacts=None, wait: bool = False) -> int:
        """Plan (fetching a hub model, so a failed download writes nothing), refuse a run that cannot fit, lock, run."""
        base_dir, steps = self.plan(dry_run=False, kinds=kinds, artifacts=artifacts)
        self.procs.stopping = False
        todo = {s.id for s in steps if is_forced(s, force) or not (s.key and self.cache.lookup(s.id, s.key))}
        try:
            self.estimates, have = (
                self.executor.preflight(self.recipe, steps, base_dir, self.cache.root, self.out_dir, todo)
                if self.executor
                else preflight.check(
                    self.recipe, steps, base_dir, self.cache.root, self.out_dir, todo, self.gpu_memory_bytes
                )
            )
        except preflight.PreflightError as e:
            raise RunError(str(e)) from None
        self.available = preflight.available_gib(have)
        self._set_deadlines(steps, base_dir, have.get("gpu"))
        self.scheduler.ram_bytes = have.get("ram_bytes")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(self.out_dir / ".quantpipe.lock"))
        try:
            lock.acquire(timeout=-1 if wait else 0)
        except Timeout:
            raise RunError(
                f"another quantpipe run is using {self.out_dir} right now; wait for it to finish, "
                "run again with --wait to queue behind it, or give this recipe another output_dir"
            ) from None
        try:
            return self._run_locked(base_dir, steps, force)
        finally:
            lock.release()

    def _run_locked(self, base_dir: str, steps: list[Step], force: set[str]) -> int:
        t_start = time.time()
        self.cache.sweep()
        measure_gate.sweep(self.tmpdir)
        run_dir = self.run_dir = new_run_dir(self.out_dir / "runs", t_start)
        run_id = run_dir.name
        handler = logging.FileHandler(run_dir / "run.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handler.addFilter(RedactFilter(self.secret_values))
        if (
            threading.current_thread() is not threading.main_thread()
        ):  # recipes of one call side by side: each run.log keeps its own
            handler.addFilter(
                lambda r, me=threading.current_thread().name, tag=f"@{id(self):x}": (
                    r.threadName == me or r.threadName.endswith(tag)
                )
            )
        logging.getLogger("quantpipe").addHandler(handler)
        close_dead_runs(self.out_dir, run_dir, self.secret_values)
        recipe_json = self.recipe.model_dump(mode="json")
        record = RunRecord(
            run_id=run_id,
            recipe_name=self.recipe.name,
            recipe_path=str(self.recipe_path.resolve()),
            recipe_hash=hash_json(recipe_json)[:16],
            command=self.command,
            recipe=recipe_json,
            status="running",
            started_at=_iso(t_start),
            quantpipe={"version": __version__, "git_commit": git_commit()},
            versions={e: versions(e) for e in ("quantize", "serve")},
            hardware=hardware(),
            cache_dir=str(self.cache.root),
            stages={},
            artifacts={},
            available=self.available,
            scheduler={
                "gpus": [g.index for g in self.gpus],
                "jobs": self.scheduler.jobs,
                "gpu_memory_gib": round(self.gpu_memory_bytes / 2**30, 2) if self.gpu_memory_bytes else None,
            },
        )
        write_record(run_dir, record, self.secret_values)
        old_handlers = self._trap_signals()
        try:
            self._log_run(
                run_id,
                status="running",
                pid=os.getpid(),
                started_at=record.started_at,
                keys={s.id: s.key for s in steps},
            )
            self.hasher.save()
            self.say(f"[bold]quantpipe[/bold] run {run_id}: {len(steps)} stages, cache {self.cache.root}")
            failed: dict[str, str] = {}
            self._run_steps(steps, base_dir, failed, force, run_dir, record, t_start)
            try:
                finish_run(self.recipe, self.out_dir, record, steps, failed, run_dir, self.say)
            except PublishError as e:
                raise RunError(str(e)) from None
        except BaseException as e:
            record.status = "interrupted" if isinstance(e, KeyboardInterrupt) else "failed"
            record.error = redact(f"{type(e).__name__}: {e}", self.secret_values)
            raise
        finally:
            self.procs.stop_all()
            record.finished_at = _iso(time.time())
            record.wall_s = round(time.time() - t_start, 2)
            write_record(run_dir, record, self.secret_values)
            index_run(self.out_dir, record, run_dir)
            self._log_run(run_id, status=record.status, finished_at=record.finished_at)
            self._restore_signals(old_handlers)
            logging.getLogger("quantpipe").removeHandler(handler)
            handler.close()
        self.say(f"run.json: {run_dir / 'run.json'}")
        return {"ok": 0, "gate_failed": EXIT_GATE}.get(record.status, EXIT_FAILED)

    def _log_run(self, run_id: str, **fields) -> None:
        """The run's line in the cache's runs.jsonl: at its start (before any stage) the keys it uses, which
        `quantpipe cache prune` keeps while the run lives; at its end its status."""
        line = {"output_dir": str(self.out_dir.resolve()), "run_id": run_id, **fields}
        if fields["status"] == "running":
            self.cache.log_run(line)  # a run that cannot say what it uses must not run: prune could take it
            return
        try:
            self.cache.log_run(line)
        except OSError as e:  # a full disk: the run's record is written all the same; prune counts the run as started
            log.warning("could not record the run's end in %s: %s", self.cache.root, e)

    def _trap_signals(self):
        def handler(signum, frame):
            # Signal only: this interrupts the stage's wait(), which holds its waitpid lock, so waiting here
            # would always time out. The interrupted spawn reaps the stage and kills what is left of its group.
            self.procs.signal_all(signal.SIGTERM)
            raise KeyboardInterrupt(f"signal {signum}")

        return (
            {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
            if threading.current_thread() is threading.main_thread()
            else {}
        )

    def _restore_signals(self, old) -> None:
        for sig, h in old.items():
            signal.signal(sig, h)


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
