"""The runner: plans a recipe's stages once, reuses cached ones, runs the rest, records the run. Merge runs once;
the unquantized merged model is the `baseline`, evaluated and benchmarked like every artifact; then per artifact
quantize -> evaluate -> benchmark -> package. Each stage is a `worker.py` subprocess in its environment
(run/process.py), committed atomically to the stage cache (run/build.py); under the vllm evaluation backend an
artifact's evaluate and benchmark, when both need building, run as one job with one server. A run writes
`<output_dir>/runs/<run_id>/` (run.json, run.log, logs/, report.*) and publishes `<output_dir>/packages/<artifact>`.

    quantpipe run recipes/demo.yaml --dry-run
"""

from __future__ import annotations

import logging
import queue
import re
import shutil
import signal
import threading
import time
from pathlib import Path

from filelock import FileLock, Timeout

from .. import __version__, preflight
from ..cache import ContentHasher, StageCache, hash_json
from ..common import measure_gate
from ..envs import LEGACY_ENVS, git_commit, hardware, python_for, versions
from ..recipe import Recipe
from ..stages.contract import Upstream
from .build import Builder, StageFailed
from .finish import finish_run
from .finish import plain as _plain
from .hub import HubError, cache_root, resolve_base
from .plan import Step, build_steps, compute_keys, select
from .process import Processes, RedactFilter, redact, secrets
from .publish import PublishError
from .record import close_dead_runs, index_run, new_run_dir, write_record
from .schedule import Grant, Scheduler, default_jobs, gpus, shares_gpu

log = logging.getLogger(__name__)
KINDS = ("merge", "quantize", "evaluate", "benchmark", "package")
EXIT_FAILED, EXIT_GATE = 1, 3


class RunError(Exception):
    """The run cannot start or go on; the message says why and what to do."""


class Runner:
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
    ):
        self.recipe = recipe
        self.recipe_path = Path(recipe_path)
        self.console = console
        self.stage_timeout_s = stage_timeout_s
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
        self.gpus = gpus(gpu_select)
        self.scheduler = Scheduler(self.gpus, jobs=jobs or default_jobs(len(self.gpus)))
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

    def dry_run(self, force: set[str], kinds=None, artifacts=None) -> list[dict]:
        base_dir, steps = self.plan(dry_run=True, kinds=kinds, artifacts=artifacts)
        have = preflight.machine(self.cache.root, self.out_dir)
        est = preflight.estimate(self.recipe, steps, base_dir, have["gpu"], have["ram_bytes"])
        rows = []
        for s in steps:
            state = "forced" if _forced(s, force) else ("hit" if s.key and self.cache.lookup(s.id, s.key) else "miss")
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
                }
            )
        self.preflight_problems = preflight.problems(
            self.recipe, est, have, {r["stage"] for r in rows if r["cache"] != "hit"}
        )
        return rows

    def run(self, force: set[str], kinds=None, artifacts=None, wait: bool = False) -> int:
        """Plan (fetching a hub model, so a failed download writes nothing), refuse a run that cannot fit, lock, run."""
        base_dir, steps = self.plan(dry_run=False, kinds=kinds, artifacts=artifacts)
        self.procs.stopping = False
        todo = {s.id for s in steps if _forced(s, force) or not (s.key and self.cache.lookup(s.id, s.key))}
        try:
            self.estimates, have = (self.executor.preflight if self.executor else preflight.check)(
                self.recipe, steps, base_dir, self.cache.root, self.out_dir, todo
            )
        except preflight.PreflightError as e:
            raise RunError(str(e)) from None
        self.available = preflight.available_gib(have)
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
        record = {
            "run_id": run_id,
            "recipe_name": self.recipe.name,
            "recipe_path": str(self.recipe_path.resolve()),
            "recipe_hash": hash_json(recipe_json)[:16],
            "recipe": recipe_json,
            "status": "running",
            "started_at": _iso(t_start),
            "quantpipe": {"version": __version__, "git_commit": git_commit()},
            "versions": {e: versions(e) for e in ("quantize", "serve")},
            "hardware": hardware(),
            "cache_dir": str(self.cache.root),
            "stages": {},
            "artifacts": {},
            "available": self.available,
            "scheduler": {"gpus": [g.index for g in self.gpus], "jobs": self.scheduler.jobs},
        }
        write_record(run_dir, record, self.secret_values)
        old_handlers = self._trap_signals()
        try:
            self.hasher.save()
            self.say(f"[bold]quantpipe[/bold] run {run_id}: {len(steps)} stages, cache {self.cache.root}")
            failed: dict[str, str] = {}
            self._run_steps(steps, base_dir, failed, force, run_dir, record, t_start)
            try:
                finish_run(self.recipe, self.out_dir, record, steps, failed, run_dir, self.say)
            except PublishError as e:
                raise RunError(str(e)) from None
        except BaseException as e:
            record["status"] = "interrupted" if isinstance(e, KeyboardInterrupt) else "failed"
            record["error"] = redact(f"{type(e).__name__}: {e}", self.secret_values)
            raise
        finally:
            self.procs.stop_all()
            record["finished_at"] = _iso(time.time())
            record["wall_s"] = round(time.time() - t_start, 2)
            write_record(run_dir, record, self.secret_values)
            index_run(self.out_dir, record, run_dir)
            self._restore_signals(old_handlers)
            logging.getLogger("quantpipe").removeHandler(handler)
            handler.close()
        self.say(f"run.json: {run_dir / 'run.json'}")
        return {"ok": 0, "gate_failed": EXIT_GATE}.get(record["status"], EXIT_FAILED)

    def _run_steps(
        self, steps: list[Step], base_dir: str, failed: dict, force: set, run_dir: Path, record: dict, t_start: float
    ) -> None:
        """Start each stage as soon as its inputs are committed and the scheduler grants it GPUs and memory."""
        ids = {s.id for s in steps}
        by_id = {s.id: s for s in steps}
        pending = sorted(
            steps, key=lambda s: s.kind != "quantize"
        )  # plan order, quantize stages first: each starts the longest chain
        done: queue.Queue = queue.Queue()
        threads: dict[str, threading.Thread] = {}

        def work(job: list[Step], grant: Grant) -> None:
            """One stage, or an evaluation with its benchmark (a joint job: one server for both)."""
            t0 = time.time()

            def early(s: Step, rec: dict) -> None:  # a joint job's evaluation, committed while its benchmark goes on
                job.remove(s)
                done.put(
                    (
                        s,
                        rec
                        | {
                            "devices": grant.gpus,
                            "start_s": round(t0 - t_start, 3),
                            "end_s": round(time.time() - t_start, 3),
                        },
                    )
                )

            try:
                recs = (
                    self._do_joint(*job, base_dir, failed, force, run_dir, grant, early)
                    if len(job) == 2
                    else [self._do_step(job[0], base_dir, failed, force, run_dir, grant)]
                )
            except BaseException as e:  # stopped by the run's interrupt (recorded, no traceback), or a runner bug (the stage fails, the run goes on)
                stopped = isinstance(e, KeyboardInterrupt)
                if not stopped:
                    log.exception("stage %s", job[-1].id)
                recs = []
                for s in job:
                    recs.append(
                        {
                            "kind": s.kind,
                            "artifact": s.artifact,
                            "env": s.env,
                            "key": s.key,
                            "status": "interrupted" if stopped else "failed",
                            "error": str(e) if stopped else f"{type(e).__name__}: {e}",
                        }
                    )
                    failed[s.id] = recs[-1]["error"]
            if grant.gate:
                shutil.rmtree(grant.gate, ignore_errors=True)
            for s, rec in zip(job, recs):  # the job's thread is known by its last step: that one is put last
                rec |= {
                    "devices": grant.gpus,
                    "start_s": round(t0 - t_start, 3),
                    "end_s": round(time.time() - t_start, 3),
                }
                if grant.gate and s.kind == "benchmark":
                    rec["measured_s"] = grant.windows  # when it had its shared GPU alone
                done.put((s, rec))

        try:
            while pending or threads or not done.empty():
                for s in list(pending):
                    if s not in pending:
                        continue  # taken this round with its evaluation (a joint job)
                    deps = [d for d in (s.src, *s.refs.values()) if d in ids]
                    broken = [d for d in deps if d in failed]
                    if broken:
                        pending.remove(s)
                        failed[s.id] = f"skipped: {broken[0]} failed"
                        self.say(f"  [yellow]-[/yellow] {s.id:<24} skipped ({broken[0]} failed)")
                        record["stages"][s.id] = {
                            "kind": s.kind,
                            "artifact": s.artifact,
                            "env": s.env,
                            "key": s.key,
                            "status": "skipped",
                            "reason": failed[s.id],
                        }
                        continue
                    if any(d not in self.records for d in deps):
                        continue  # an input is not committed yet
                    if s.kind == "benchmark" and any(p.joint == s.id for p in pending):
                        continue  # its evaluation is decided first: through this benchmark's server, or on its own
                    if not _forced(s, force) and self.cache.lookup(s.id, s.key) is not None:
                        pending.remove(s)  # a cache hit needs no GPU: checked here, in order
                        work([s], Grant([]))
                        continue
                    job = [s]
                    b = by_id.get(s.joint)
                    if (
                        b in pending
                        and (_forced(b, force) or self.cache.lookup(b.id, b.key) is None)
                        and all(d in self.records for d in (b.src, *b.refs.values()) if d in ids)
                    ):
                        job = [s, b]  # both to build: one job, on the benchmark's terms (whole GPUs, or the host alone)
                    head = job[-1]
                    tp = (head.inp.benchmark.engine.tensor_parallel_size or 1) if head.kind == "benchmark" else 1
                    share = head.kind == "benchmark" and self.executor is None and shares_gpu(head.inp.benchmark)
                    grant = self.scheduler.try_start(
                        head.id, head.kind, self.estimates.get(head.id), n_gpus=tp, share=share
                    )
                    if grant is None:
                        continue
                    if share and not grant.exclusive:
                        grant.gate = measure_gate.new_folder(self.tmpdir)
                    for x in job:
                        pending.remove(x)
                    threads[head.id] = threading.Thread(
                        target=work, args=(job, grant), name=f"{head.id}@{id(self):x}", daemon=True
                    )
                    threads[head.id].start()
                if self.executor is None:  # with Ray, benchmarks keep whole GPUs
                    self._tend_gates(t_start)
                if not threads and done.empty():
                    if pending:  # nothing runs and nothing can start: a dependency outside the plan, or a bug
                        raise RunError(
                            f"no stage can start: {', '.join(s.id for s in pending)} wait for inputs that are not planned"
                        )
                    break
                try:
                    s, rec = done.get(timeout=0.5)
                except queue.Empty:
                    continue
                th = threads.pop(s.id, None)
                if th is not None:
                    th.join()
                    self.scheduler.finish(s.id)
                rec["preflight"] = {
                    "estimate": preflight.record(self.estimates, s.id),
                    "actual": preflight.actual_peak(rec.get("metrics", {})),
                }
                record["stages"][s.id] = rec
                write_record(run_dir, record, self.secret_values)
        finally:
            if threads:  # interrupted: stop every running stage, then let their threads clean up their work folders
                self.procs.stop_all()
                for th in threads.values():
                    th.join(timeout=30)

    def _tend_gates(self, t_start: float) -> None:
        """Let each shared benchmark asking to measure (measure_gate.py) go once its GPU is otherwise idle."""
        for sid, g in list(self.scheduler.running.items()):
            if not g.gate:
                continue
            n, state = measure_gate.latest(g.gate)
            if state == "want" and g.phase != "measuring":
                first = g.phase == "busy"
                self.scheduler.wait_to_measure(sid)
                if self.scheduler.try_measure(sid):
                    measure_gate.grant(g.gate, n)
                    g.windows.append([round(time.time() - t_start, 3), None])
                elif first:
                    where = f"GPU {','.join(g.gpus)}" if g.gpus else "the host"
                    self.say(
                        f"  [dim]…[/dim] {sid:<24} waits for {where} to itself to measure "
                        f"(busy: {', '.join(self.scheduler.blockers(sid))})"
                    )
            elif state == "done" and g.phase == "measuring":
                self.scheduler.end_measure(sid)
                g.windows[-1][1] = round(time.time() - t_start, 3)

    def _do_step(
        self, s: Step, base_dir: str, failed: dict, force: set, run_dir: Path, grant: Grant, built=None
    ) -> dict:
        """Reuse or build one stage and record it; `built`: what a joint job made of it ((marker, state) or StageFailed)."""
        rec = {"kind": s.kind, "artifact": s.artifact, "env": s.env, "key": s.key}
        t0 = time.perf_counter()
        forced = _forced(s, force)
        marker = None if forced or built is not None else self.cache.lookup(s.id, s.key)
        state = "forced" if forced else "miss"
        if marker is not None:
            problems = self.cache.verify_entry(s.id, s.key, marker, full=True)
            if problems:
                log.warning("cache entry %s/%s is corrupt (%s); rebuilding it", s.id, s.key, "; ".join(problems[:5]))
                self.say(f"  [yellow]![/yellow] {s.id}: cached output is corrupt ({_plain(problems[0])}); rebuilding")
                self.cache.discard(s.id, s.key)
                marker, state = None, "rebuilt"
        if marker is None:
            try:  # with Ray a node takes the entry's lock, builds and commits it (run/ray_executor.py)
                if isinstance(built, StageFailed):
                    raise built
                marker, state = built or (
                    self.executor.build(s, base_dir, run_dir, forced, state)
                    if self.executor
                    else self.builder.build_locked(s, base_dir, run_dir, grant, forced, state)
                )
            except StageFailed as e:
                if (
                    self.procs.stopping
                ):  # its processes were stopped by the run's interrupt (a SIGKILL among them): not a failure
                    raise KeyboardInterrupt(f"{s.id} was stopped: the run was interrupted") from None
                failed[s.id] = str(e)
                after = f" after {time.perf_counter() - t0:.1f}s" if built is None else ""
                self.say(f"  [red]x[/red] {s.id:<24} FAILED{after}: {_plain(e.summary)}")
                return {
                    **rec,
                    "cache": state,
                    "status": "failed",
                    "error": e.summary,
                    "log": str(e.log_path),
                    "log_tail": e.tail,
                }
        else:
            state = "hit"
        out = self.cache.entry(s.id, s.key) / "out"
        metrics = marker.get("metrics", {})
        self.records[s.id] = Upstream(out=out, stage=s.id, key=s.key, wall_s=marker.get("wall_s"), metrics=metrics)
        dt = marker.get("wall_s") or 0.0 if built is not None and state != "hit" else time.perf_counter() - t0
        note = f" ({_plain(str(metrics['status_note']))})" if metrics.get("status_note") else ""
        self.say(f"  [green]✓[/green] {s.id:<24} {state:<6} {dt:7.1f}s{note}")
        return {
            **rec,
            "cache": state,
            "status": "ok",
            "wall_s": round(dt, 3),
            "stage_wall_s": marker.get("wall_s"),
            "metrics": metrics,
            "out": str(out),
            **({"placement": marker["placement"]} if "placement" in marker else {}),
        }

    def _do_joint(
        self, e: Step, b: Step, base_dir: str, failed: dict, force: set, run_dir: Path, grant: Grant, early=None
    ) -> list[dict]:
        """An artifact's evaluation and benchmark from one serve-environment process, each with its own key and entry.
        `early(step, record)` gets the evaluation's record once committed, so what reads it may start."""
        forced = {s.id: _forced(s, force) for s in (e, b)}
        state = {sid: "forced" if f else "miss" for sid, f in forced.items()}
        sent = []

        def on_eval(built_e) -> None:
            rec = self._do_step(e, base_dir, failed, force, run_dir, grant, built=built_e)
            sent.append(e)
            if early is not None:
                early(e, rec)

        built = (
            self.executor.build_joint(e, b, base_dir, run_dir, forced, state)
            if self.executor  # one Ray task, a node takes both locks
            else self.builder.build_joint_locked(e, b, base_dir, run_dir, grant, forced, state, on_eval)
        )
        return [
            self._do_step(s, base_dir, failed, force, run_dir, grant, built=built[s.id])
            for s in (e, b)
            if s not in sent
        ]

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


def _forced(s: Step, force: set[str]) -> bool:
    return bool(force) and ("all" in force or s.kind in force or s.id in force)


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
