"""Running a plan's steps: each stage starts as soon as what it reads is committed and the scheduler (run/schedule.py)
grants it GPUs and memory, in a thread of its own; it is reused from the cache or built (run/build.py, or a Ray node
under `--executor ray`) and recorded in run.json as it finishes. An evaluation and its benchmark that both need building
go as one job with one server, and a benchmark that shares its GPU is let measure (common/measure_gate.py) once the GPU
is otherwise idle. `StepDispatch` is a base of `Runner` (run/runner.py), which holds the state it works on: the cache,
scheduler, builder, executor, processes, pre-flight estimates and the records of committed stages.

    quantpipe run recipes/demo.yaml --jobs 2
"""

from __future__ import annotations

import logging
import queue
import shutil
import threading
import time
from pathlib import Path

from .. import preflight
from ..cache import StageCache
from ..common import measure_gate
from ..server_output import fault_recorded_as_verdict
from ..stages.contract import Upstream
from .build import Builder, StageFailed
from .finish import plain as _plain
from .plan import Step
from .process import Processes
from .record import RunRecord, StageRecord, write_record
from .schedule import Grant, Scheduler, shares_gpu

log = logging.getLogger("quantpipe.run.runner")  # run.log names the runner for every line of a run


class RunError(Exception):
    """The run cannot start or go on; the message says why and what to do."""


class StepDispatch:
    """Starts, reuses or builds, and records the steps of a plan; `Runner` supplies the state (see above)."""

    # set by Runner.__init__
    cache: StageCache
    scheduler: Scheduler
    builder: Builder
    executor: object  # None, or --executor ray's stages (their procs and scheduler replace these)
    procs: Processes
    tmpdir: Path
    secret_values: list[str]
    estimates: dict
    records: dict[str, Upstream]

    def say(self, msg: str) -> None: ...

    def _run_steps(
        self,
        steps: list[Step],
        base_dir: str,
        failed: dict,
        force: set,
        run_dir: Path,
        record: RunRecord,
        t_start: float,
    ) -> None:
        """Start each stage as soon as its inputs are committed and the scheduler grants it GPUs and memory."""
        ids = {s.id for s in steps}
        by_id = {s.id: s for s in steps}
        pending = sorted(
            steps, key=lambda s: s.kind != "quantize"
        )  # plan order, quantize stages first: each starts the longest chain
        done: queue.Queue = queue.Queue()
        threads: dict[str, threading.Thread] = {}
        retry = _Retry()  # benchmarks whose server failed beside other work: tried once more, alone on their GPU

        def work(job: list[Step], grant: Grant) -> None:
            """One stage, or an evaluation with its benchmark (a joint job: one server for both)."""
            t0 = time.time()

            def early(s: Step, rec: StageRecord) -> None:
                """A joint job's evaluation, committed while its benchmark goes on."""
                job.remove(s)
                done.put(
                    (
                        s,
                        rec.model_copy(
                            update={
                                "devices": grant.gpus,
                                "start_s": round(t0 - t_start, 3),
                                "end_s": round(time.time() - t_start, 3),
                            }
                        ),
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
                        StageRecord(
                            kind=s.kind,
                            artifact=s.artifact,
                            env=s.env,
                            key=s.key,
                            status="interrupted" if stopped else "failed",
                            error=str(e) if stopped else f"{type(e).__name__}: {e}",
                        )
                    )
                    failed[s.id] = recs[-1].error
            if grant.gate:
                shutil.rmtree(grant.gate, ignore_errors=True)
            for s, rec in zip(job, recs):  # the job's thread is known by its last step: that one is put last
                rec.devices = grant.gpus
                rec.start_s = round(t0 - t_start, 3)
                rec.end_s = round(time.time() - t_start, 3)
                if grant.gate and s.kind == "benchmark":
                    rec.measured_s = grant.windows  # when it had its shared GPU alone
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
                        record.stages[s.id] = StageRecord(
                            kind=s.kind,
                            artifact=s.artifact,
                            env=s.env,
                            key=s.key,
                            status="skipped",
                            reason=failed[s.id],
                        )
                        continue
                    if any(d not in self.records for d in deps):
                        continue  # an input is not committed yet
                    if s.kind == "benchmark" and any(p.joint == s.id for p in pending):
                        continue  # its evaluation is decided first: through this benchmark's server, or on its own
                    if not is_forced(s, force) and self._lookup(s) is not None:
                        pending.remove(s)  # a cache hit needs no GPU: checked here, in order
                        work([s], Grant([]))
                        continue
                    job = [s]
                    b = by_id.get(s.joint)
                    if (
                        b in pending
                        and (is_forced(b, force) or self._lookup(b) is None)
                        and all(d in self.records for d in (b.src, *b.refs.values()) if d in ids)
                    ):
                        job = [s, b]  # both to build: one job, on the benchmark's terms (whole GPUs, or the host alone)
                    head = job[-1]
                    tp = (head.inp.benchmark.engine.tensor_parallel_size or 1) if head.kind == "benchmark" else 1
                    share = (
                        head.kind == "benchmark"
                        and self.executor is None
                        and shares_gpu(head.inp.benchmark, any(g.name != "simulated" for g in self.scheduler.gpus))
                        and head.id not in retry.alone
                    )
                    grant = self.scheduler.try_start(
                        head.id, head.kind, self.estimates.get(head.id), n_gpus=tp, share=share
                    )
                    if grant is None:
                        continue
                    if share and not grant.exclusive:
                        grant.gate = measure_gate.new_folder(self.tmpdir)
                        retry.shared |= {x.id for x in job}
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
                again = retry.again(s, rec, by_id, failed)
                if again is not None:
                    pending.extend(again)
                    if again:
                        self.say(
                            f"  [yellow]↻[/yellow] {s.id:<24} failed beside other work on its GPU ({_plain(rec.error or '')[:160]}); "
                            "trying it again with the GPU to itself"
                        )
                    continue
                self._record(s, rec, record, run_dir, retry, failed)
        finally:
            if threads:  # interrupted: stop every running stage, then let their threads clean up their work folders
                self.procs.stop_all()
                for th in threads.values():
                    th.join(timeout=30)

    def _record(self, s: Step, rec: StageRecord, record: RunRecord, run_dir: Path, retry: _Retry, failed: dict) -> None:
        """Put a finished stage's record (and an evaluation held back for it) into run.json; learn from a benchmark."""
        held = retry.release(s.id, failed)
        if held is not None:
            record.stages[held[0].id] = held[1]
        if s.id in retry.first:
            rec.retried = retry.first[s.id]
        rec.preflight = {
            "estimate": preflight.record(self.estimates, s.id),
            "actual": preflight.actual_peak(rec.metrics),
            "deadline_s": self.deadline_s(s.id),
        }
        record.stages[s.id] = rec
        if s.kind == "benchmark" and rec.status == "ok" and rec.cache != "hit":  # sizes the next servers
            preflight.learn_server_overhead(self.cache.root, rec.metrics)
        write_record(run_dir, record, self.secret_values)

    def _lookup(self, s: Step) -> dict | None:
        """The cache entry of `s`, unless it is a benchmark that recorded a fault of its host as "not servable here"
        (an entry written before faults failed their stage): that one is discarded, and the stage measured again."""
        marker = self.cache.lookup(s.id, s.key)
        fault = fault_recorded_as_verdict(marker.get("metrics") or {}) if marker and s.kind == "benchmark" else None
        if fault:
            self.say(
                f"  [yellow]![/yellow] {s.id}: its cached result says not servable because {fault}, a fault of the host; measuring it again"
            )
            self.cache.discard(s.id, s.key)
            return None
        return marker

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
                        f"(after: {', '.join(self.scheduler.blockers(sid))})"
                    )
            elif state == "done" and g.phase == "measuring":
                self.scheduler.end_measure(sid)
                g.windows[-1][1] = round(time.time() - t_start, 3)

    def _do_step(
        self, s: Step, base_dir: str, failed: dict, force: set, run_dir: Path, grant: Grant, built=None
    ) -> StageRecord:
        """Reuse or build one stage and record it; `built`: what a joint job made of it ((marker, state) or StageFailed)."""
        rec = StageRecord(kind=s.kind, artifact=s.artifact, env=s.env, key=s.key)
        t0 = time.perf_counter()
        forced = is_forced(s, force)
        marker = None if forced or built is not None else self._lookup(s)
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
                return rec.model_copy(
                    update={
                        "cache": state,
                        "status": "failed",
                        "fault": e.fault or None,
                        "error": e.summary,
                        "log": str(e.log_path),
                        "log_tail": e.tail,
                    }
                )
        else:
            state = "hit"
        out = self.cache.entry(s.id, s.key) / "out"
        metrics = marker.get("metrics", {})
        self.records[s.id] = Upstream(out=out, stage=s.id, key=s.key, wall_s=marker.get("wall_s"), metrics=metrics)
        dt = marker.get("wall_s") or 0.0 if built is not None and state != "hit" else time.perf_counter() - t0
        note = f" ({_plain(str(metrics['status_note']))})" if metrics.get("status_note") else ""
        self.say(f"  [green]✓[/green] {s.id:<24} {state:<6} {dt:7.1f}s{note}")
        return rec.model_copy(
            update={
                "cache": state,
                "status": "ok",
                "wall_s": round(dt, 3),
                "stage_wall_s": marker.get("wall_s"),
                "metrics": metrics,
                "out": str(out),
                **({"placement": marker["placement"]} if "placement" in marker else {}),
            }
        )

    def _do_joint(
        self, e: Step, b: Step, base_dir: str, failed: dict, force: set, run_dir: Path, grant: Grant, early=None
    ) -> list[StageRecord]:
        """An artifact's evaluation and benchmark from one serve-environment process, each with its own key and entry.
        `early(step, record)` gets the evaluation's record once committed, so what reads it may start."""
        forced = {s.id: is_forced(s, force) for s in (e, b)}
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


class _Retry:
    """Which failed stages are tried again in the same run: a benchmark (with its joint evaluation) whose server failed
    for a reason of the host while it shared its GPU, once, with the GPU to itself."""

    def __init__(self):
        self.shared: set[str] = set()  # stages started on a shared GPU
        self.alone: set[str] = set()  # benchmarks to start with their GPU to themselves
        self.first: dict[str, str] = {}  # stage id -> the error of its first try
        self.held: dict[str, tuple[Step, StageRecord]] = {}  # benchmark id -> its joint evaluation's failed record

    def again(self, s: Step, rec: StageRecord, by_id: dict[str, Step], failed: dict) -> list[Step] | None:
        """The steps to queue again after `rec` ([] to hold it back until its benchmark's record), or None: record it."""
        if not (rec.status == "failed" and rec.fault and s.id in self.shared and s.id not in self.first):
            return None
        if s.kind == "evaluate" and s.joint in by_id and s.joint not in self.first:
            self.held[s.joint] = (s, rec)  # decided when its benchmark's record comes
            failed.pop(s.id, None)  # nothing that reads it is skipped meanwhile
            return []
        if s.kind != "benchmark":
            return None
        self.first[s.id] = rec.error or ""
        self.alone.add(s.id)
        steps = [s]
        held = self.held.pop(s.id, None)
        if held is not None:
            self.first[held[0].id] = held[1].error or ""
            steps.insert(0, held[0])
        for x in steps:
            failed.pop(x.id, None)
        return steps

    def release(self, sid: str, failed: dict) -> tuple[Step, StageRecord] | None:
        """The evaluation held back for benchmark `sid`, when the benchmark is not tried again: it is recorded as failed."""
        held = self.held.pop(sid, None)
        if held is not None:
            failed[held[0].id] = held[1].error
        return held


def is_forced(s: Step, force: set[str]) -> bool:
    return bool(force) and ("all" in force or s.kind in force or s.id in force)
