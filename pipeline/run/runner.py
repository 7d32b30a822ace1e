"""The runner: plans a recipe's stages once, reuses cached ones, runs the rest, records the run.

Order: merge once; the unquantized merged model is the `baseline` that is evaluated and benchmarked
like every artifact; then per artifact quantize -> evaluate -> benchmark -> package; one report.
Each stage runs as a subprocess (`worker.py`) in its environment, in its own process group (run/process.py), and
its output is committed to the stage cache atomically. A run writes `<output_dir>/runs/<run_id>/` (run.json,
run.log, logs/, report.*) and publishes `<output_dir>/packages/<artifact>` by an atomic symlink swap (run/publish.py).

    quantpipe run recipes/demo.yaml --dry-run
"""

from __future__ import annotations

import json
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
from ..envs import LEGACY_ENVS, git_commit, hardware, python_for, versions
from ..recipe import Recipe
from ..stages.contract import Upstream
from .hub import HubError, cache_root, resolve_base
from .plan import Step, build_steps, compute_keys, select
from .process import Processes, RedactFilter, exit_reason, redact, secrets, tail
from .publish import PublishError, publish
from .record import close_dead_runs, index_run, new_run_dir, write_record
from .schedule import Grant, Scheduler, default_jobs, gpus

log = logging.getLogger(__name__)
WORKER = Path(__file__).resolve().parent.parent / "worker.py"
KINDS = ("merge", "quantize", "evaluate", "benchmark", "package")
EXIT_FAILED, EXIT_GATE = 1, 3


class RunError(Exception):
    """The run cannot start or go on; the message says why and what to do."""


class Runner:
    def __init__(self, recipe: Recipe, recipe_path: Path, console=None, verbose: bool = False, stage_timeout_s: float | None = None,
                 jobs: int | None = None, gpu_select: str | None = None, executor=None):
        self.recipe = recipe
        self.recipe_path = Path(recipe_path)
        self.console = console
        self.stage_timeout_s = stage_timeout_s
        self.cache = StageCache(cache_root(recipe))
        self.hasher = ContentHasher(cache_root(recipe) / "hashes.json")
        self.out_dir = Path(recipe.output_dir)
        self.secret_values = secrets()
        self.procs = Processes(self.cache.root / "tmp", self.secret_values, verbose)
        self.preflight_problems: list[str] = []  # what pre-flight would refuse (dry run)
        self.estimates: dict = {}  # stage id -> pre-flight estimate
        self.available: dict | None = None  # what pre-flight compared the estimates with
        self.records: dict[str, Upstream] = {}  # stage id -> its committed output, key, wall time and metrics
        self.run_dir: Path | None = None  # the last run's folder (the CLI prints its summary from there)
        self.gpus = gpus(gpu_select)
        self.scheduler = Scheduler(self.gpus, jobs=jobs or default_jobs(len(self.gpus)))
        self.executor = executor.attach(self) if executor is not None else None  # --executor ray: its procs and scheduler replace these

    def say(self, msg: str) -> None:
        if self.console is not None:
            self.console.print(msg, highlight=False)
        log.info(re.sub(r"\[/?[a-z ]+\]", "", msg).replace("\\[", "["))

    def plan(self, dry_run: bool, kinds=None, artifacts=None) -> tuple[str, list[Step]]:
        if artifacts:
            unknown = set(artifacts) - {a.name for a in self.recipe.artifacts}
            if unknown:
                raise RunError(f"--artifacts: no artifact named {', '.join(sorted(unknown))} in the recipe; it has {', '.join(a.name for a in self.recipe.artifacts)}")
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
            rows.append({"stage": s.id, "env": s.env, "key": s.key[:12], "cache": state, "ram_gib": e.get("ram_gib"), "gpu_gib": e.get("gpu_gib"),
                         "disk_gib": (e.get("disk_cache_gib", 0) + e.get("disk_output_gib", 0)) if e else None})
        self.preflight_problems = preflight.problems(self.recipe, est, have, {r["stage"] for r in rows if r["cache"] != "hit"})
        return rows

    def run(self, force: set[str], kinds=None, artifacts=None, wait: bool = False) -> int:
        """Plan (a hub model is fetched here, so a failed download writes nothing either), refuse a run that will
        not fit before anything is written, then take the output directory's lock and run."""
        base_dir, steps = self.plan(dry_run=False, kinds=kinds, artifacts=artifacts)
        todo = {s.id for s in steps if _forced(s, force) or not (s.key and self.cache.lookup(s.id, s.key))}
        try:
            self.estimates, have = (self.executor.preflight if self.executor else preflight.check)(self.recipe, steps, base_dir, self.cache.root, self.out_dir, todo)
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
        run_dir = self.run_dir = new_run_dir(self.out_dir / "runs", t_start)
        run_id = run_dir.name
        handler = logging.FileHandler(run_dir / "run.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handler.addFilter(RedactFilter(self.secret_values))
        if threading.current_thread() is not threading.main_thread():  # recipes of one call side by side: each run.log keeps its own
            handler.addFilter(lambda r, me=threading.current_thread().name, tag=f"@{id(self):x}": r.threadName == me or r.threadName.endswith(tag))
        logging.getLogger("quantpipe").addHandler(handler)
        close_dead_runs(self.out_dir, run_dir, self.secret_values)
        recipe_json = self.recipe.model_dump(mode="json")
        record = {
            "run_id": run_id, "recipe_name": self.recipe.name, "recipe_path": str(self.recipe_path.resolve()),
            "recipe_hash": hash_json(recipe_json)[:16], "recipe": recipe_json, "status": "running",
            "started_at": _iso(t_start), "quantpipe": {"version": __version__, "git_commit": git_commit()},
            "versions": {e: versions(e) for e in ("quantize", "serve")}, "hardware": hardware(),
            "cache_dir": str(self.cache.root), "stages": {}, "artifacts": {}, "available": self.available,
            "scheduler": {"gpus": [g.index for g in self.gpus], "jobs": self.scheduler.jobs},
        }
        write_record(run_dir, record, self.secret_values)
        old_handlers = self._trap_signals()
        try:
            self.hasher.save()
            self.say(f"[bold]quantpipe[/bold] run {run_id}: {len(steps)} stages, cache {self.cache.root}")
            failed: dict[str, str] = {}
            self._run_steps(steps, base_dir, failed, force, run_dir, record, t_start)
            self._finish(record, steps, failed, run_dir)
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

    def _run_steps(self, steps: list[Step], base_dir: str, failed: dict, force: set, run_dir: Path, record: dict, t_start: float) -> None:
        """Start each stage as soon as its inputs are committed and the scheduler grants it GPUs and memory."""
        ids = {s.id for s in steps}
        pending = list(steps)
        done: queue.Queue = queue.Queue()
        threads: dict[str, threading.Thread] = {}

        def work(s: Step, grant: Grant) -> None:
            t0 = time.time()
            try:
                rec = self._do_step(s, base_dir, failed, force, run_dir, grant)
            except BaseException as e:  # stopped by the run's interrupt (recorded, no traceback), or a runner bug (the stage fails, the run goes on)
                stopped = isinstance(e, KeyboardInterrupt)
                if not stopped:
                    log.exception("stage %s", s.id)
                rec = {"kind": s.kind, "artifact": s.artifact, "env": s.env, "key": s.key, "status": "interrupted" if stopped else "failed", "error": str(e) if stopped else f"{type(e).__name__}: {e}"}
                failed[s.id] = rec["error"]
            rec |= {"devices": grant.gpus, "start_s": round(t0 - t_start, 3), "end_s": round(time.time() - t_start, 3)}
            done.put((s, rec))

        try:
            while pending or threads or not done.empty():
                for s in list(pending):
                    deps = [d for d in (s.src, *s.refs.values()) if d in ids]
                    broken = [d for d in deps if d in failed]
                    if broken:
                        pending.remove(s)
                        failed[s.id] = f"skipped: {broken[0]} failed"
                        self.say(f"  [yellow]-[/yellow] {s.id:<24} skipped ({broken[0]} failed)")
                        record["stages"][s.id] = {"kind": s.kind, "artifact": s.artifact, "env": s.env, "key": s.key, "status": "skipped", "reason": failed[s.id]}
                        continue
                    if any(d not in self.records for d in deps):
                        continue  # an input is not committed yet
                    tp = (s.inp.benchmark.engine.tensor_parallel_size or 1) if s.kind == "benchmark" else 1
                    if not _forced(s, force) and self.cache.lookup(s.id, s.key) is not None:
                        pending.remove(s)  # a cache hit needs no GPU: checked here, in order
                        work(s, Grant([]))
                        continue
                    grant = self.scheduler.try_start(s.id, s.kind, self.estimates.get(s.id), n_gpus=tp)
                    if grant is None:
                        continue
                    pending.remove(s)
                    threads[s.id] = threading.Thread(target=work, args=(s, grant), name=f"{s.id}@{id(self):x}", daemon=True)
                    threads[s.id].start()
                if not threads and done.empty():
                    if pending:  # nothing runs and nothing can start: a dependency outside the plan, or a bug
                        raise RunError(f"no stage can start: {', '.join(s.id for s in pending)} wait for inputs that are not planned")
                    break
                try:
                    s, rec = done.get(timeout=0.5)
                except queue.Empty:
                    continue
                th = threads.pop(s.id, None)
                if th is not None:
                    th.join()
                    self.scheduler.finish(s.id)
                rec["preflight"] = {"estimate": preflight.record(self.estimates, s.id), "actual": preflight.actual_peak(rec.get("metrics", {}))}
                record["stages"][s.id] = rec
                write_record(run_dir, record, self.secret_values)
        finally:
            if threads:  # interrupted: stop every running stage, then let their threads clean up their work folders
                self.procs.stop_all()
                for th in threads.values():
                    th.join(timeout=30)

    def _do_step(self, s: Step, base_dir: str, failed: dict, force: set, run_dir: Path, grant: Grant) -> dict:
        rec = {"kind": s.kind, "artifact": s.artifact, "env": s.env, "key": s.key}
        t0 = time.perf_counter()
        forced = _forced(s, force)
        marker = None if forced else self.cache.lookup(s.id, s.key)
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
                marker, state = (self.executor.build(s, base_dir, run_dir, forced, state) if self.executor
                                 else self._build_locked(s, base_dir, run_dir, grant, forced, state))
            except StageFailed as e:
                failed[s.id] = str(e)
                self.say(f"  [red]x[/red] {s.id:<24} FAILED after {time.perf_counter() - t0:.1f}s: {_plain(e.summary)}")
                return {**rec, "cache": state, "status": "failed", "error": e.summary, "log": str(e.log_path), "log_tail": e.tail}
        else:
            state = "hit"
        out = self.cache.entry(s.id, s.key) / "out"
        metrics = marker.get("metrics", {})
        self.records[s.id] = Upstream(out=out, stage=s.id, key=s.key, wall_s=marker.get("wall_s"), metrics=metrics)
        dt = time.perf_counter() - t0
        note = f" ({_plain(str(metrics['status_note']))})" if metrics.get("status_note") else ""
        self.say(f"  [green]✓[/green] {s.id:<24} {state:<6} {dt:7.1f}s{note}")
        return {**rec, "cache": state, "status": "ok", "wall_s": round(dt, 3), "stage_wall_s": marker.get("wall_s"), "metrics": metrics, "out": str(out),
                **({"placement": marker["placement"]} if "placement" in marker else {})}

    def _build_locked(self, s: Step, base_dir: str, run_dir: Path, grant: Grant, forced: bool, state: str) -> tuple[dict, str]:
        """Under the entry's lock: another run may be building the same entry; wait, then reuse it."""
        self.cache.entry(s.id, s.key).parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(self.cache.entry(s.id, s.key)) + ".lock"):
            marker = None if forced else self.cache.lookup(s.id, s.key)
            return (marker, "hit") if marker is not None else (self._build(s, base_dir, run_dir, grant), state)

    def _build(self, s: Step, base_dir: str, run_dir: Path, grant: Grant) -> dict:
        work = self.cache.begin(s.id, s.key)
        src = base_dir if s.src == "external" else str(self.records[s.src].out)
        upstream = {role: self.records[sid] for role, sid in s.refs.items() if sid in self.records}
        if s.kind == "package":  # its manifest names the key of the entry it is built into
            upstream["self"] = Upstream(out=work / "out", stage=s.id, key=s.key)
        spec = {
            "stage": s.id, "kind": s.kind, "input": s.inp.model_dump(mode="json"), "src": src, "out": str(work / "out"),
            "upstream": {role: u.to_json() for role, u in upstream.items()}, "metrics": str(work / "metrics.json"),
        }
        (work / "spec.json").write_text(json.dumps(spec, indent=2, default=str))
        log_path = run_dir / "logs" / f"{s.id.replace(':', '_')}.log"
        on = f" on GPU {','.join(grant.gpus)}" if grant.gpus else ""
        self.say(f"  [cyan]>[/cyan] {s.id:<24} running in the {s.env} environment{on} (log: {log_path})")
        t0 = time.perf_counter()
        try:
            env = {"CUDA_VISIBLE_DEVICES": ",".join(grant.gpus)} if grant.gpus else {}
            rc = self.procs.spawn([str(python_for(s.env)), str(WORKER), str(work / "spec.json")], log_path, self.stage_timeout_s, env)
        except BaseException:  # Ctrl-C or SIGTERM: the stage was stopped, its half output goes
            shutil.rmtree(work, ignore_errors=True)
            raise
        if rc != 0:
            last = tail(log_path)
            shutil.rmtree(work, ignore_errors=True)
            if rc is None:  # ran past --stage-timeout and was stopped
                raise StageFailed(f"{s.id} ran longer than --stage-timeout ({self.stage_timeout_s / 60:g} min) and was stopped with its "
                                  f"processes; nothing of it was kept. Raise --stage-timeout if it needs longer (its log: {log_path})",
                                  log_path, last)
            err = [ln for ln in last.splitlines() if ln.startswith("STAGE_ERROR: ")]
            summary = err[-1].removeprefix("STAGE_ERROR: ") if err else f"{exit_reason(rc)}; last lines of {log_path}:\n{last}"
            raise StageFailed(summary, log_path, last)
        metrics = json.loads((work / "metrics.json").read_text())
        (work / "metrics.json").unlink()
        (work / "spec.json").unlink()
        try:
            return self.cache.commit(work, s.id, s.key, {"metrics": metrics, "wall_s": round(time.perf_counter() - t0, 3)},
                                     inputs=[src, *(str(u.out) for role, u in upstream.items() if role != "self")])
        except OSError as e:
            shutil.rmtree(work, ignore_errors=True)
            raise StageFailed(f"could not commit the output of {s.id} to {self.cache.root}: {e}", log_path, "") from None

    def _finish(self, record: dict, steps: list[Step], failed: dict, run_dir: Path) -> None:
        from ..common.gates import check_gates

        gates = self.recipe.evaluation.gates
        any_gate_failed = False
        for a in self.recipe.artifacts:
            ids = [s.id for s in steps if s.artifact == a.name]
            if not ids:
                continue
            art = {"method": a.method, "stages": {i: record["stages"][i]["status"] for i in ids}}
            ev = record["stages"].get(f"evaluate:{a.name}", {})
            if ev.get("status") == "ok":
                failures = check_gates(gates, ev.get("metrics", {}))
                art["gate"] = "FAIL" if failures else "PASS"
                art["gate_failures"] = failures
                any_gate_failed |= bool(failures)
            else:
                art["gate"] = "NOT RUN"
            pkg = record["stages"].get(f"package:{a.name}", {})
            if pkg.get("status") == "ok":
                try:
                    art["package"] = str(publish(self.out_dir, a.name, Path(pkg["out"]), record["stages"][f"package:{a.name}"]["key"]))
                except PublishError as e:
                    raise RunError(str(e)) from None
                except OSError as e:  # a full or read-only output disk: the package stays cached, nothing half-published
                    why = e.args[0][0][2] if isinstance(e, shutil.Error) and e.args and e.args[0] else str(e)  # copytree: (src, dst, why) per file
                    art["package_error"] = f"could not publish the package to {self.out_dir / 'packages' / a.name}: {why}"
                    failed[f"publish:{a.name}"] = art["package_error"]
                    self.say(f"  [red]x[/red] {'publish:' + a.name:<24} FAILED: {_plain(art['package_error'])}")
            record["artifacts"][a.name] = art
        record["status"] = "failed" if failed else ("gate_failed" if any_gate_failed else "ok")
        try:
            from ..report import write_report

            record["report"] = [str(p) for p in write_report(record, run_dir, self.out_dir)]  # the CLI's summary names it
        except Exception as e:  # a report bug must not hide the run's results
            log.exception("report failed")
            record["report_error"] = f"{type(e).__name__}: {e}"
            record["status"] = "failed"
        for a, art in record["artifacts"].items():  # the console shows the gates in its summary table (quantpipe.console)
            log.info("%s gate %s %s", a, art.get("gate"), "; ".join(art.get("gate_failures", [])))
        if failed:
            self.say(f"[red]{len(failed)} stage(s) did not complete:[/red] " + ", ".join(sorted(failed)))

    def _trap_signals(self):
        def handler(signum, frame):
            # Signal only: this interrupts the stage's wait(), which holds its waitpid lock, so waiting here
            # would always time out. The interrupted spawn reaps the stage and kills what is left of its group.
            self.procs.signal_all(signal.SIGTERM)
            raise KeyboardInterrupt(f"signal {signum}")

        return {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)} if threading.current_thread() is threading.main_thread() else {}

    def _restore_signals(self, old) -> None:
        for sig, h in old.items():
            signal.signal(sig, h)


class StageFailed(Exception):
    def __init__(self, summary: str, log_path: Path, tail: str):
        super().__init__(summary)
        self.summary, self.log_path, self.tail = summary, log_path, tail


def _forced(s: Step, force: set[str]) -> bool:
    return bool(force) and ("all" in force or s.kind in force or s.id in force)


def _plain(text: str) -> str:
    """Text from a stage or the disk, for the console: brackets in it are not rich markup (`[/path]` would raise)."""
    from rich.markup import escape

    return escape(text)


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
