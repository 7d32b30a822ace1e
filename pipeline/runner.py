"""The runner: plans the stages of a recipe, reuses cached ones, runs the rest, records the run.

Order: merge once; the unquantized merged model is the `baseline` that is evaluated and benchmarked
like every artifact; then per artifact quantize -> evaluate -> benchmark -> package; one report.
Each stage runs as a subprocess (`worker.py`) in its environment, in its own process group, and
its output is committed to the stage cache atomically. A run writes `<output_dir>/runs/<run_id>/`
(run.json, run.log, logs/, report.*) and publishes packages to `<output_dir>/packages/<artifact>`
by an atomic symlink swap.

    quantpipe run recipes/demo.yaml --dry-run
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from filelock import FileLock, Timeout

from . import __version__, preflight
from .cache import ContentHasher, StageCache, hash_json
from .envs import LEGACY_ENVS, STAGES, git_commit, hardware, hardware_key, lock_hash, python_for, source_hash, stage_env, versions
from .recipe import Recipe

log = logging.getLogger(__name__)
WORKER = Path(__file__).resolve().parent / "worker.py"
KINDS = ("merge", "quantize", "evaluate", "benchmark", "package")
SECRET_ENV = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|ACCESS_KEY|PRIVATE_KEY|CREDENTIAL)", re.I)
EXIT_FAILED, EXIT_GATE = 1, 3


class RunError(Exception):
    """The run cannot start or go on; the message says why and what to do."""


@dataclass
class Step:
    id: str
    kind: str
    artifact: str | None
    src: str  # step id of the input, or "external"
    refs: dict[str, str] = field(default_factory=dict)  # role -> step id
    values: dict = field(default_factory=dict)  # plain keyword arguments for the stage
    cfg: dict = field(default_factory=dict)  # what of the recipe the stage reads (goes into its key)
    key: str = ""
    env: str = ""  # the environment it runs in; empty: the stage kind's default (envs.STAGES)

    def __post_init__(self) -> None:
        self.env = self.env or STAGES[self.kind][1]


def cache_root(recipe: Recipe) -> Path:
    if recipe.cache_dir:
        return Path(recipe.cache_dir)
    return Path(os.environ.get("QUANTPIPE_CACHE", Path.home() / ".cache" / "quantpipe"))


def secrets() -> list[str]:
    return [v for k, v in os.environ.items() if SECRET_ENV.search(k) and len(v) >= 6]


def redact(text: str, values: list[str] | None = None) -> str:
    for v in values if values is not None else secrets():
        text = text.replace(v, "***")
    return text


# --- planning ---------------------------------------------------------------------------------


def build_steps(recipe: Recipe, base_dir: str) -> list[Step]:
    """The stages of a recipe, in the order they run, with what each reads."""
    r = recipe
    steps = [Step("merge", "merge", None, "external", values={"base_dir": base_dir}, cfg={"base": r.base.model_dump(exclude={"model"}), "adapters": [a.weight for a in r.adapters]})]
    ev = r.evaluation
    evaluate = ev.lm_eval is not None or ev.validation is not None
    ev_cfg = ev.model_dump(exclude={"gates"})
    bench_cfg = {"benchmark": r.benchmark.model_dump(), "hardware": hardware_key()}
    common = {"dtype": r.base.dtype, "trust_remote_code": r.base.trust_remote_code}
    if evaluate:
        steps.append(Step("evaluate:baseline", "evaluate", "baseline", "merge", values={"artifact": "baseline", "method": "none"}, cfg={**ev_cfg, **common}))
    if r.benchmark.enabled:
        steps.append(Step("benchmark:baseline", "benchmark", "baseline", "merge", values={"artifact": "baseline", "method": "none", "base_dir": base_dir}, cfg={**bench_cfg, **common, "adapters": len(r.adapters)}))
    for a in r.artifacts:
        q = f"quantize:{a.name}"
        acfg = a.model_dump(exclude={"name"})
        steps.append(Step(q, "quantize", a.name, "merge", values={"artifact": a.name}, cfg={"artifact": acfg, "calibration": r.calibration.model_dump() if r.calibration else None, **common}, env=stage_env("quantize", a)))
        if evaluate:
            steps.append(Step(f"evaluate:{a.name}", "evaluate", a.name, q, refs={"baseline_model": "merge", "baseline_eval": "evaluate:baseline"}, values={"artifact": a.name, "method": a.method}, cfg={**ev_cfg, **common}, env=stage_env("evaluate", a)))
        if r.benchmark.enabled:
            steps.append(Step(f"benchmark:{a.name}", "benchmark", a.name, q, values={"artifact": a.name, "method": a.method}, cfg={**bench_cfg, **common}))
        if r.package.enabled:
            refs = {"merged": "merge"}
            if evaluate:
                refs |= {"evaluation": f"evaluate:{a.name}", "baseline_eval": "evaluate:baseline"}
            if r.benchmark.enabled:
                refs |= {"benchmark": f"benchmark:{a.name}", "baseline_benchmark": "benchmark:baseline"}
            summary = r.model_dump(include={"name", "notes", "base", "adapters", "calibration", "evaluation", "benchmark", "package"})
            steps.append(Step(f"package:{a.name}", "package", a.name, q, refs=refs, values={"artifact": a.name}, cfg={"recipe": summary, "artifact": acfg}))
    if evaluate:
        from .stages.evaluate import lm_eval_backend

        backend = lm_eval_backend(r)  # auto: vllm where a CUDA GPU is present, else hf
        for s in steps:
            if s.kind == "evaluate":
                s.values["backend"] = backend
                if backend == "vllm":
                    s.env = "serve"  # lm-eval's vllm model needs vLLM: the baseline and every artifact alike
    return steps


def external_inputs(recipe: Recipe, base_dir: str) -> dict[str, list[str]]:
    """Files outside the cache that each stage kind reads (their content goes into the key)."""
    ev = recipe.evaluation
    ev_files = [p for p in (ev.validation.path if ev.validation else None, ev.validation.json_schema if ev.validation else None, ev.lm_eval.include_path if ev.lm_eval else None) if p]
    return {
        "merge": [base_dir] + [a.path for a in recipe.adapters],
        "quantize": [s.path for s in (recipe.calibration.sources if recipe.calibration else []) if s.path],
        "evaluate": ev_files,
        "benchmark": [ev.validation.path] if ev.validation else [],
        "package": [],
    }


def compute_keys(steps: list[Step], recipe: Recipe, base_dir: str, hasher: ContentHasher) -> None:
    ext = external_inputs(recipe, base_dir)
    by_id = {}
    for s in steps:
        inputs = {"src": by_id[s.src].key if s.src in by_id else None}
        inputs |= {role: by_id[sid].key for role, sid in s.refs.items() if sid in by_id}
        files = [hasher.tree(Path(p)) for p in ext[s.kind]]
        if s.kind == "benchmark" and s.values.get("base_dir"):
            files.append(hasher.tree(Path(base_dir)))
        s.key = hash_json({
            "kind": s.kind, "id": s.id, "cfg": s.cfg, "values": {k: v for k, v in s.values.items() if k != "base_dir"},
            "inputs": inputs, "files": files, "code": source_hash(s.kind), "env": lock_hash(s.env),
        })[:32]
        by_id[s.id] = s


def resolve_base(recipe: Recipe, dry_run: bool) -> str:
    """The local directory of the base model, downloading a hub id where a network allows."""
    if recipe.base.is_local:
        return recipe.base.model
    if dry_run:
        return recipe.base.model
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "tokenizer*"]
        if recipe.base.allow_pickle:
            patterns.append("*.bin")
        return snapshot_download(recipe.base.model, revision=recipe.base.revision, allow_patterns=patterns)
    except Exception as e:  # offline, unknown repo, gated repo...
        raise RunError(
            f"base.model: cannot fetch {recipe.base.model!r} from the hub ({type(e).__name__}: {str(e)[:200]}). "
            "Without a network, download it on a machine that has one and set base.model to the local directory."
        ) from None


def select(steps: list[Step], kinds: set[str] | None, artifacts: set[str] | None) -> list[Step]:
    """Steps to run for --stages/--artifacts, with everything they depend on."""
    by_id = {s.id: s for s in steps}
    wanted = {s.id for s in steps if (kinds is None or s.kind in kinds) and (artifacts is None or s.artifact in (None, "baseline") or s.artifact in artifacts)}
    if artifacts is not None:
        wanted = {i for i in wanted if by_id[i].artifact in (None, "baseline") or by_id[i].artifact in artifacts}
    todo = list(wanted)
    while todo:
        s = by_id[todo.pop()]
        for d in [s.src, *s.refs.values()]:
            if d in by_id and d not in wanted:
                wanted.add(d)
                todo.append(d)
    return [s for s in steps if s.id in wanted]


# --- running ----------------------------------------------------------------------------------


class Runner:
    def __init__(self, recipe: Recipe, recipe_path: Path, console=None, verbose: bool = False, stage_timeout_s: float | None = None):
        self.recipe = recipe
        self.recipe_path = Path(recipe_path)
        self.console = console
        self.verbose = verbose
        self.stage_timeout_s = stage_timeout_s
        self.cache = StageCache(cache_root(recipe))
        self.hasher = ContentHasher(cache_root(recipe) / "hashes.json")
        self.out_dir = Path(recipe.output_dir)
        self.children: set[subprocess.Popen] = set()
        self.secret_values = secrets()

    def say(self, msg: str) -> None:
        if self.console is not None:
            self.console.print(msg, highlight=False)
        log.info(re.sub(r"\[/?[a-z ]+\]", "", msg).replace("\\[", "["))

    def plan(self, dry_run: bool, kinds=None, artifacts=None) -> tuple[str, list[Step]]:
        if artifacts:
            unknown = set(artifacts) - {a.name for a in self.recipe.artifacts}
            if unknown:
                raise RunError(f"--artifacts: no artifact named {', '.join(sorted(unknown))} in the recipe; it has {', '.join(a.name for a in self.recipe.artifacts)}")
        base_dir = resolve_base(self.recipe, dry_run)
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

    def _preflight(self, force: set[str], kinds, artifacts) -> dict:
        """Estimate each stage's memory and disk and refuse, before anything is written, a run that will not fit.
        A hub model is fetched here, so that its config is known and a failed download writes nothing either."""
        base_dir, steps = self.plan(dry_run=False, kinds=kinds, artifacts=artifacts)
        todo = {s.id for s in steps if _forced(s, force) or not (s.key and self.cache.lookup(s.id, s.key))}
        try:
            est, have = preflight.check(self.recipe, steps, base_dir, self.cache.root, self.out_dir, todo)
        except preflight.PreflightError as e:
            raise RunError(str(e)) from None
        self.available = preflight.available_gib(have)
        return est

    def run(self, force: set[str], kinds=None, artifacts=None, wait: bool = False) -> int:
        self.estimates = self._preflight(force, kinds, artifacts)
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
            return self._run_locked(force, kinds, artifacts)
        finally:
            lock.release()

    def _run_locked(self, force, kinds, artifacts) -> int:
        t_start = time.time()
        self.cache.sweep()
        run_id = time.strftime("%Y%m%d-%H%M%S", time.gmtime(t_start)) + f"-{os.getpid()}"
        run_dir = self.out_dir / "runs" / run_id
        (run_dir / "logs").mkdir(parents=True)
        handler = logging.FileHandler(run_dir / "run.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handler.addFilter(_RedactFilter(self.secret_values))
        logging.getLogger("quantpipe").addHandler(handler)
        self._close_dead_runs(run_dir)
        recipe_json = self.recipe.model_dump(mode="json")
        record = {
            "run_id": run_id, "recipe_name": self.recipe.name, "recipe_path": str(self.recipe_path.resolve()),
            "recipe_hash": hash_json(recipe_json)[:16], "recipe": recipe_json, "status": "running",
            "started_at": _iso(t_start), "quantpipe": {"version": __version__, "git_commit": git_commit()},
            "versions": {e: versions(e) for e in ("quantize", "serve")}, "hardware": hardware(),
            "cache_dir": str(self.cache.root), "stages": {}, "artifacts": {},
        }
        record["available"] = getattr(self, "available", None)  # what pre-flight compared the estimates with
        self._write_record(run_dir, record)
        old_handlers = self._trap_signals(run_dir, record)
        try:
            base_dir, steps = self.plan(dry_run=False, kinds=kinds, artifacts=artifacts)
            self.hasher.save()
            self.say(f"[bold]quantpipe[/bold] run {run_id}: {len(steps)} stages, cache {self.cache.root}")
            outs: dict[str, Path] = {}
            failed: dict[str, str] = {}
            for s in steps:
                rec = self._do_step(s, base_dir, outs, failed, force, run_dir)
                rec["preflight"] = {"estimate": preflight.record(getattr(self, "estimates", {}), s.id), "actual": preflight.actual_peak(rec.get("metrics", {}))}
                record["stages"][s.id] = rec
                self._write_record(run_dir, record)
            self._finish(record, steps, outs, failed, run_dir)
        except BaseException as e:
            record["status"] = "interrupted" if isinstance(e, KeyboardInterrupt) else "failed"
            record["error"] = redact(f"{type(e).__name__}: {e}", self.secret_values)
            raise
        finally:
            self._kill_children()
            record["finished_at"] = _iso(time.time())
            record["wall_s"] = round(time.time() - t_start, 2)
            self._write_record(run_dir, record)
            self._index(record, run_dir)
            self._restore_signals(old_handlers)
            logging.getLogger("quantpipe").removeHandler(handler)
            handler.close()
        self.say(f"run.json: {run_dir / 'run.json'}")
        return {"ok": 0, "gate_failed": EXIT_GATE}.get(record["status"], EXIT_FAILED)

    def _do_step(self, s: Step, base_dir: str, outs: dict, failed: dict, force: set, run_dir: Path) -> dict:
        rec = {"kind": s.kind, "artifact": s.artifact, "env": s.env, "key": s.key}
        broken = [d for d in [s.src, *s.refs.values()] if d in failed]
        if broken:
            failed[s.id] = f"skipped: {broken[0]} failed"
            self.say(f"  [yellow]-[/yellow] {s.id:<24} skipped ({broken[0]} failed)")
            return {**rec, "status": "skipped", "reason": failed[s.id]}
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
            entry_lock = FileLock(str(self.cache.entry(s.id, s.key)) + ".lock")
            self.cache.entry(s.id, s.key).parent.mkdir(parents=True, exist_ok=True)
            with entry_lock:  # another run may be building the same entry: wait, then reuse it
                marker = None if forced else self.cache.lookup(s.id, s.key)
                if marker is None:
                    try:
                        marker = self._build(s, base_dir, outs, run_dir)
                    except StageFailed as e:
                        failed[s.id] = str(e)
                        self.say(f"  [red]x[/red] {s.id:<24} FAILED after {time.perf_counter() - t0:.1f}s: {_plain(e.summary)}")
                        return {**rec, "cache": state, "status": "failed", "error": e.summary, "log": str(e.log_path), "log_tail": e.tail}
                else:
                    state = "hit"
        else:
            state = "hit"
        outs[s.id] = self.cache.entry(s.id, s.key) / "out"
        metrics = marker.get("metrics", {})
        dt = time.perf_counter() - t0
        note = f" ({_plain(str(metrics['status_note']))})" if metrics.get("status_note") else ""
        self.say(f"  [green]✓[/green] {s.id:<24} {state:<6} {dt:7.1f}s{note}")
        return {**rec, "cache": state, "status": "ok", "wall_s": round(dt, 3), "stage_wall_s": marker.get("wall_s"), "metrics": metrics, "out": str(outs[s.id])}

    def _build(self, s: Step, base_dir: str, outs: dict, run_dir: Path) -> dict:
        work = self.cache.begin(s.id, s.key)
        src = base_dir if s.src == "external" else str(outs[s.src])
        refs = {role: str(outs[sid]) for role, sid in s.refs.items() if sid in outs}
        spec = {
            "stage": s.id, "kind": s.kind, "recipe": self.recipe.model_dump(mode="json"), "src": src,
            "out": str(work / "out"), "refs": {**refs, **s.values}, "metrics": str(work / "metrics.json"),
        }
        (work / "spec.json").write_text(json.dumps(spec, indent=2))
        log_path = run_dir / "logs" / f"{s.id.replace(':', '_')}.log"
        self.say(f"  [cyan]>[/cyan] {s.id:<24} running in the {s.env} environment (log: {log_path})")
        t0 = time.perf_counter()
        try:
            rc = self._spawn(s, [str(python_for(s.env)), str(WORKER), str(work / "spec.json")], log_path)
        except BaseException:  # Ctrl-C or SIGTERM: the stage was stopped, its half output goes
            shutil.rmtree(work, ignore_errors=True)
            raise
        if rc != 0:
            tail = _tail(log_path)
            shutil.rmtree(work, ignore_errors=True)
            if rc is None:  # ran past --stage-timeout and was stopped
                raise StageFailed(f"{s.id} ran longer than --stage-timeout ({self.stage_timeout_s / 60:g} min) and was stopped with its "
                                  f"processes; nothing of it was kept. Raise --stage-timeout if it needs longer (its log: {log_path})",
                                  log_path, tail)
            err = [ln for ln in tail.splitlines() if ln.startswith("STAGE_ERROR: ")]
            summary = err[-1].removeprefix("STAGE_ERROR: ") if err else f"{_exit_reason(rc)}; last lines of {log_path}:\n{tail}"
            raise StageFailed(summary, log_path, tail)
        metrics = json.loads((work / "metrics.json").read_text())
        (work / "metrics.json").unlink()
        (work / "spec.json").unlink()
        try:
            return self.cache.commit(work, s.id, s.key, {"metrics": metrics, "wall_s": round(time.perf_counter() - t0, 3)},
                                     inputs=[src, *refs.values()])
        except OSError as e:
            shutil.rmtree(work, ignore_errors=True)
            raise StageFailed(f"could not commit the output of {s.id} to {self.cache.root}: {e}", log_path, "") from None

    def _spawn(self, s: Step, cmd: list[str], log_path: Path) -> int | None:
        """Run a stage worker in its own process group; its exit code, or None if it ran past the stage timeout."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "QUANTPIPE_RUNNER_PID": str(os.getpid())}
        env.setdefault("TMPDIR", str(self.cache.root / "tmp"))
        Path(env["TMPDIR"]).mkdir(parents=True, exist_ok=True)
        with open(log_path, "w") as logf:
            logf.write(f"$ {' '.join(cmd)}\n")
            logf.flush()
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
            self.children.add(p)
            pump = threading.Thread(target=self._pump, args=(p.stdout, logf), daemon=True)
            pump.start()
            try:
                rc = p.wait(timeout=self.stage_timeout_s)
            except subprocess.TimeoutExpired:  # a hung stage: SIGTERM (the worker ends its group), then SIGKILL
                _killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    pass
                rc = None
            finally:
                pump.join(timeout=10)
                self.children.discard(p)
                _killpg(p.pid, signal.SIGKILL)  # anything the stage left behind in its group
        return rc

    def _pump(self, stream, logf) -> None:
        for raw in iter(stream.readline, b""):
            line = redact(raw.decode("utf-8", "replace"), self.secret_values)
            try:
                logf.write(line)
                logf.flush()
            except (OSError, ValueError):
                pass  # the log's disk is full: keep draining, or the stage would block on a full pipe
            if self.verbose:
                sys.stderr.write(line)

    def _finish(self, record: dict, steps: list[Step], outs: dict, failed: dict, run_dir: Path) -> None:
        from .stages.evaluate import check_gates

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
                    art["package"] = str(self._publish(a.name, Path(pkg["out"]), record["stages"][f"package:{a.name}"]["key"]))
                except OSError as e:  # a full or read-only output disk: the package stays cached, nothing half-published
                    why = e.args[0][0][2] if isinstance(e, shutil.Error) and e.args and e.args[0] else str(e)  # copytree: (src, dst, why) per file
                    art["package_error"] = f"could not publish the package to {self.out_dir / 'packages' / a.name}: {why}"
                    failed[f"publish:{a.name}"] = art["package_error"]
                    self.say(f"  [red]x[/red] {'publish:' + a.name:<24} FAILED: {_plain(art['package_error'])}")
            record["artifacts"][a.name] = art
        record["status"] = "failed" if failed else ("gate_failed" if any_gate_failed else "ok")
        try:
            from .report import write_report

            record["report"] = [str(p) for p in write_report(record, run_dir, self.out_dir)]
            self.say(f"report: {run_dir / 'report.html'}")
        except Exception as e:  # a report bug must not hide the run's results
            log.exception("report failed")
            record["report_error"] = f"{type(e).__name__}: {e}"
            record["status"] = "failed"
        for a, art in record["artifacts"].items():
            colour = {"PASS": "green", "FAIL": "red"}.get(art.get("gate"), "yellow")
            self.say(f"  {a:<16} gate [{colour}]{art.get('gate')}[/{colour}] {'; '.join(art.get('gate_failures', []))}")
        if failed:
            self.say(f"[red]{len(failed)} stage(s) did not complete:[/red] " + ", ".join(sorted(failed)))

    def _publish(self, artifact: str, src: Path, key: str) -> Path:
        """Copy a package out of the cache and swap it in atomically: packages/<artifact> is a link."""
        pk = self.out_dir / "packages"
        store = pk / ".store" / f"{artifact}-{key[:16]}"
        for d in (pk, pk / ".store"):
            if d.is_symlink():  # planted: publishing through it would write outside the output directory
                raise RunError(f"{d} is a symbolic link; packages are published only inside {self.out_dir}: remove the link and run again")
        for stale in [*(pk / ".store").glob(f".{artifact}.tmp-*"), *pk.glob(f".{artifact}.link-*")]:
            # half copies and links of runs killed while publishing (this run holds the output lock)
            stale.unlink() if stale.is_symlink() or not stale.is_dir() else shutil.rmtree(stale, ignore_errors=True)
        if not store.exists():
            tmp = pk / ".store" / f".{artifact}.tmp-{os.getpid()}"
            try:
                shutil.copytree(src, tmp, symlinks=False)
                os.rename(tmp, store)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        link = pk / artifact
        tmp_link = pk / f".{artifact}.link-{os.getpid()}"
        if tmp_link.is_symlink():
            tmp_link.unlink()
        os.symlink(os.path.relpath(store, pk), tmp_link)
        if link.exists() and not link.is_symlink():
            shutil.rmtree(link)
        os.replace(tmp_link, link)
        for old in (pk / ".store").glob(f"{artifact}-*"):
            if old != store:
                shutil.rmtree(old, ignore_errors=True)
        return link

    def _close_dead_runs(self, this_run: Path) -> None:
        """Records still "running" belong to runs that died without closing them (kill -9, power loss):
        this run holds the output directory's lock, so none of them is alive. Mark them killed and index them."""
        for path in sorted((self.out_dir / "runs").glob("*/run.json")):
            if path.parent == this_run:
                continue
            try:
                rec = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if rec.get("status") == "running":
                rec["status"] = "killed"
                rec["error"] = f"the run ended without closing its record (killed, or the machine went down); found by run {this_run.name}"
                self._write_record(path.parent, rec)
                self._index(rec, path.parent)
                log.warning("run %s was killed before it finished; its committed stages stay cached", rec.get("run_id"))

    def _write_record(self, run_dir: Path, record: dict) -> None:
        tmp = run_dir / ".run.json.tmp"
        tmp.write_text(redact(json.dumps(record, indent=2, default=str), self.secret_values))
        os.replace(tmp, run_dir / "run.json")

    def _index(self, record: dict, run_dir: Path) -> None:
        line = {k: record.get(k) for k in ("run_id", "recipe_name", "recipe_hash", "started_at", "finished_at", "status")}
        line["run_dir"] = str(run_dir)
        with open(self.out_dir / "runs" / "index.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")

    def _trap_signals(self, run_dir, record):
        def handler(signum, frame):
            # Signal only: this interrupts the stage's wait(), which holds its waitpid lock, so waiting here
            # would always time out. The interrupted _spawn reaps the stage and kills what is left of its group.
            for p in list(self.children):
                _killpg(p.pid, signal.SIGTERM)
            raise KeyboardInterrupt(f"signal {signum}")

        return {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)} if threading.current_thread() is threading.main_thread() else {}

    def _restore_signals(self, old) -> None:
        for sig, h in old.items():
            signal.signal(sig, h)

    def _kill_children(self) -> None:
        for p in list(self.children):
            _killpg(p.pid, signal.SIGTERM)
        deadline = time.time() + 10
        for p in list(self.children):
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
            _killpg(p.pid, signal.SIGKILL)


class StageFailed(Exception):
    def __init__(self, summary: str, log_path: Path, tail: str):
        super().__init__(summary)
        self.summary, self.log_path, self.tail = summary, log_path, tail


class _RedactFilter(logging.Filter):
    def __init__(self, values):
        super().__init__()
        self.values = values

    def filter(self, record):
        record.msg = redact(record.getMessage(), self.values)
        record.args = None
        return True


def _forced(s: Step, force: set[str]) -> bool:
    return bool(force) and ("all" in force or s.kind in force or s.id in force)


def _killpg(pid: int, sig) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _plain(text: str) -> str:
    """Text from a stage or the disk, for the console: brackets in it are not rich markup (`[/path]` would raise)."""
    from rich.markup import escape

    return escape(text)


def _exit_reason(rc: int) -> str:
    if rc >= 0:
        return f"exit code {rc}"
    try:
        name = signal.Signals(-rc).name
    except ValueError:
        name = f"signal {-rc}"
    hint = " (the kernel's out-of-memory killer sends SIGKILL: check `dmesg` and the stage's memory)" if -rc == signal.SIGKILL else ""
    return f"killed by {name}{hint}"


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
