"""One recipe's stages on a Ray cluster (`--executor ray`): what replaces the runner's pre-flight, scheduler and
builder once `RayCluster.attach` makes the cluster its executor. Each stage to build becomes one Ray task with the
request the cluster computes for it; an entry another recipe of the same run is building is waited for, not built
twice; an evaluation and its benchmark go as one task; what the node reports back (built, found built, busy, failed,
cancelled, retried elsewhere) becomes the runner's marker, placement record or StageFailed.

    stages = cluster.attach(runner)   # runner.procs and runner.scheduler are now these
    marker, state = stages.build(step, base_dir, run_dir, forced=False, state="miss")
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..deadline import past_deadline
from ..envs import lock_hash, source_hash
from .build import StageFailed
from .process import exit_reason, tail
from .ray_probe import PACKAGE
from .schedule import Grant

MAX_RETRIES = 3  # Ray re-runs a task whose node or worker died this many times (not one whose stage failed)
RUN_ENV = (
    "HF_HUB_OFFLINE",
    "HF_DATASETS_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "QUANTPIPE_VERIFY",
)  # the driver's, handed to stages


def fmt_resource(resource: str, v) -> str:
    return f"{v / 2**30:.1f} GiB" if resource == "memory" else f"{v:g}"


class Unlimited:
    """With Ray, Ray places stages by their requests; this only caps how many one recipe has submitted (--jobs)."""

    def __init__(self, jobs: int | None):
        self.jobs, self.running, self.ram_bytes = jobs, set(), None

    def try_start(self, sid, kind, est, n_gpus: int = 1, share: bool = False) -> Grant | None:
        if self.jobs and len(self.running) >= self.jobs:
            return None
        self.running.add(sid)
        return Grant([])

    def finish(self, sid) -> None:
        self.running.discard(sid)


class RayStages:
    """One recipe's stages on the cluster: the runner's pre-flight, scheduler and builder when --executor ray."""

    def __init__(self, cluster, runner):
        self.cluster, self.runner = cluster, runner
        self.scheduler = Unlimited(cluster.jobs)
        self.refs: dict[str, object] = {}  # stage id -> its running task
        self.cancels: dict[str, Path] = {}  # stage id -> the file that tells its task to stop
        self.joint_out: dict[str, dict | None] = {}  # evaluate stage id -> what its benchmark's task made of it

    def preflight(self, recipe, steps, base_dir, cache_dir, out_dir, todo):
        """Pre-flight against the cluster's nodes (the largest one's memory and GPU), not against this driver's host."""
        from .. import preflight
        from .publish import unpublished

        c = self.cluster
        c.check([Path(cache_dir)], {s.env for s in steps}, {s.kind for s in steps})
        real = [n["gpu"] for n in c._live() if n.get("gpu")]
        gpu = max(real, key=lambda g: g["total_bytes"]) if real else None
        have = {
            "ram_bytes": max((n.get("ram_bytes") or 0 for n in c._live()), default=None) or None,
            "gpu": gpu,
            "disk": preflight.machine(cache_dir, out_dir)["disk"],
        }
        est = preflight.estimate(recipe, steps, base_dir, gpu, have["ram_bytes"])
        bad = preflight.problems(recipe, est, have, todo, unpublished(steps, out_dir))
        for s in steps:
            tp = (s.inp.benchmark.engine.tensor_parallel_size or 1) if s.kind == "benchmark" else 1
            why = c.infeasible(s.id, c.request(s.kind, est.get(s.id), tp)) if s.id in todo else None
            bad += [why] if why else []
        if bad and os.environ.get("QUANTPIPE_PREFLIGHT", "").lower() not in ("off", "0", "false", "no"):
            raise preflight.PreflightError(
                "pre-flight: this run would not fit the Ray cluster:\n" + "\n".join(f"  - {p}" for p in bad)
            )
        return est, have

    def build(self, s, base_dir: str, run_dir: Path, forced: bool, state: str) -> tuple[dict, str]:
        """Build one entry on the cluster; a recipe asking for an entry another recipe is building waits for that build."""
        fut, mine = self.cluster.claim((s.id, s.key))
        while not mine:
            self.runner.say(f"  [cyan]>[/cyan] {s.id:<24} being built for another recipe of this run; waiting for it")
            try:
                return {k: v for k, v in fut.result().items() if k != "placement"}, "hit"
            except Released:  # given back unbuilt (build_joint): claim it again
                fut, mine = self.cluster.claim((s.id, s.key))
        try:
            marker, state = self._submit(s, base_dir, run_dir, forced, state)
        except BaseException as e:
            fut.set_exception(e)
            raise
        else:
            fut.set_result(marker)
            return marker, state
        finally:
            self.cluster.done((s.id, s.key))

    def build_joint(self, e, b, base_dir: str, run_dir: Path, forced: dict, state: dict) -> dict:
        """An evaluation and its benchmark as one task, one server for both: {stage id: (marker, state) or StageFailed}.
        Each on its own where another recipe of this run is building either, or the node finds either built."""
        claims = {x.id: self.cluster.claim((x.id, x.key)) for x in (e, b)}
        if not all(mine for _, mine in claims.values()):
            for x in (e, b):
                if claims[x.id][1]:  # given back unbuilt: a recipe waiting for it claims it again
                    self.cluster.done((x.id, x.key))
                    claims[x.id][0].set_exception(Released())
            return {
                x.id: _attempt(lambda x=x: self.build(x, base_dir, run_dir, forced[x.id], state[x.id])) for x in (e, b)
            }
        built: dict = {}
        try:
            built[b.id] = _attempt(
                lambda: self._submit(b, base_dir, run_dir, forced[b.id], state[b.id], joint=(e, forced[e.id]))
            )
            j = self.joint_out.pop(e.id, None) or {"state": "split"}
            if j["state"] == "built":
                built[e.id] = (j["marker"], state[e.id])
            elif j["state"] == "failed":
                log_path = run_dir / "logs" / f"{b.id.replace(':', '_')}.log"
                built[e.id] = StageFailed(j["summary"], log_path, tail(log_path))
            else:  # the task never ran it: on its own
                built[e.id] = _attempt(lambda: self._submit(e, base_dir, run_dir, forced[e.id], state[e.id]))
        except BaseException as exc:
            for x in (e, b):
                claims[x.id][0].set_exception(exc)
            raise
        else:
            for x in (e, b):
                res = built[x.id]
                claims[x.id][0].set_exception(res) if isinstance(res, StageFailed) else claims[x.id][0].set_result(
                    res[0]
                )
            return built
        finally:
            for x in (e, b):
                self.cluster.done((x.id, x.key))

    def _spec(self, s, base_dir: str) -> dict:
        r = self.runner
        upstream = {role: r.records[sid].to_json() for role, sid in s.refs.items() if sid in r.records}
        return {
            "stage": s.id,
            "kind": s.kind,
            "input": s.inp.model_dump(mode="json"),
            "src": base_dir if s.src == "external" else str(r.records[s.src].out),
            "upstream": upstream,
        }

    def _submit(self, s, base_dir: str, run_dir: Path, forced: bool, state: str, joint=None) -> tuple[dict, str]:
        """Build `s` as one task; `joint` (evaluate step, forced): its evaluation too, whose outcome goes to joint_out."""
        r, c, ray = self.runner, self.cluster, self.cluster.ray
        spec = self._spec(s, base_dir)
        name = s.id.replace(":", "_")
        live = (
            r.cache.root / "tmp" / "ray" / run_dir.name / name
        )  # the stage's log and attempts while it runs (every node sees it)
        live.mkdir(parents=True, exist_ok=True)
        log_path = run_dir / "logs" / f"{name}.log"
        job = {
            "cache": str(r.cache.root),
            "stage": s.id,
            "kind": s.kind,
            "key": s.key,
            "env": s.env,
            "forced": forced,
            "spec": spec,
            "log": str(live / "stage.log"),
            "attempts": str(live / "attempts.jsonl"),
            "cancel": str(live / "cancel"),
            "timeout_s": r.deadline_s(s.id),
            "run_env": {k: os.environ[k] for k in RUN_ENV if k in os.environ},
            "expect": {"env": lock_hash(s.env), "code": source_hash(s.kind)},
        }
        if joint is not None:
            e, forced_e = joint
            job["joint"] = {
                "stage": e.id,
                "kind": e.kind,
                "key": e.key,
                "env": e.env,
                "forced": forced_e,
                "spec": self._spec(e, base_dir),
                "expect": {"env": lock_hash(e.env), "code": source_hash(e.kind)},
            }
        tp = (s.inp.benchmark.engine.tensor_parallel_size or 1) if s.kind == "benchmark" else 1
        req = c.request(s.kind, r.estimates.get(s.id), tp)
        asks = ", ".join(
            f"{k.removeprefix('num_')} {fmt_resource('memory' if k == 'memory' else k, v)}" for k, v in req.items() if v
        )
        r.say(f"  [cyan]>[/cyan] {s.id:<24} submitted to Ray ({asks}) in the {s.env} environment (log: {log_path})")
        while True:
            if c.stopping:
                raise KeyboardInterrupt("the run was interrupted")
            ref = c.task.options(
                **req, max_retries=MAX_RETRIES, retry_exceptions=False, name=f"quantpipe {s.id}"
            ).remote(PACKAGE, "run_stage", job)
            self.refs[s.id], self.cancels[s.id] = ref, live / "cancel"
            try:
                out = ray.get(ref)
            except ray.exceptions.TaskCancelledError:
                raise KeyboardInterrupt(f"{s.id} was cancelled") from None
            except ray.exceptions.RayError as e:
                _move(Path(job["log"]), log_path)
                why = getattr(e, "cause", None) or e  # a task's own exception, else what Ray says happened to it
                raise StageFailed(
                    f"Ray could not run {s.id} ({type(why).__name__}: {str(why).strip().splitlines()[-1][:300]}); nothing of "
                    f"it was committed; the next run builds it again",
                    log_path,
                    tail(log_path),
                ) from None
            finally:
                self.refs.pop(s.id, None)
                self.cancels.pop(s.id, None)
            if out["state"] == "split":  # the node found one of the two built: each on its own
                return self._submit(s, base_dir, run_dir, forced, state)
            if joint is not None:
                self.joint_out[joint[0].id] = out.get("joint")
            if out["state"] != "busy":
                break
            # another run holds the entry's lock: wait for it here, where waiting holds no cluster resources
            r.say(f"  [cyan]>[/cyan] {s.id:<24} another run is building this entry; waiting for it")
            with r.cache.lock(s.id, s.key):
                marker = None if forced else r.cache.lookup(s.id, s.key)
            if marker is not None:
                return marker, "hit"
        _move(Path(job["log"]), log_path)
        attempts = _read_attempts(Path(job["attempts"]))
        (live / "cancel").unlink(missing_ok=True)
        for d in (live, live.parent):  # the run's last stage leaves no folder behind
            try:
                d.rmdir()
            except OSError:
                pass
        if out["state"] == "hit":
            return out["marker"], "hit"
        if out["state"] == "cancelled":
            raise KeyboardInterrupt(f"{s.id} was stopped: the run was interrupted")
        if out["state"] == "failed":
            last = tail(log_path)
            if out.get("summary"):
                raise StageFailed(out["summary"], log_path, last)
            if out.get("rc") is None:
                raise StageFailed(
                    past_deadline(s.id, r.deadline_s(s.id), r.stage_timeout_s is not None, log_path),
                    log_path,
                    last,
                )
            err = [ln for ln in last.splitlines() if ln.startswith("STAGE_ERROR: ")]
            raise StageFailed(
                err[-1].removeprefix("STAGE_ERROR: ")
                if err
                else f"{exit_reason(out['rc'])}; last lines of {log_path}:\n{last}",
                log_path,
                last,
            )
        c.refresh()
        placement = {
            "executor": "ray",
            "node": c.name(out["node_id"]),
            "request": req,
            "gpu_ids": out.get("gpu_ids"),
            "attempts": [{**a, "node": c.name(a["node_id"])} for a in attempts],
        }
        if len(attempts) > 1:
            lost = round(attempts[-1]["started_at"] - attempts[0]["started_at"], 1)
            gone = ", ".join(c.name(a["node_id"]) for a in attempts[:-1])
            placement |= {
                "lost_s": lost,
                "note": f"{s.id}: lost with node {gone}; Ray ran it again on {placement['node']}, {lost:g} s after "
                f"the first attempt began ({len(attempts)} attempts, nothing of the lost one committed)",
            }
            r.say(f"  [yellow]![/yellow] {placement['note']}")
        return {**out["marker"], "placement": placement}, state

    def signal_all(self, sig) -> None:
        """Ask every running task of this recipe to stop its stage (a file each one watches; from a signal handler)."""
        for cancel in list(self.cancels.values()):
            try:
                cancel.touch()
            except OSError:
                pass

    def stop_all(self) -> None:
        """Ask this recipe's tasks to stop and clean up; Ray kills the rest after 20 s (the next build clears them)."""
        self.signal_all(None)
        refs = list(self.refs.values())
        if refs:
            _, late = self.cluster.ray.wait(refs, num_returns=len(refs), timeout=20)
            for ref in late:
                try:
                    self.cluster.ray.cancel(ref, force=True)
                except Exception:
                    pass


class Released(Exception):
    """A claim on an entry given back unbuilt: claim it again."""


def _attempt(build):
    """build()'s (marker, state), or the StageFailed it raised."""
    try:
        return build()
    except StageFailed as e:
        return e


def _move(src: Path, dst: Path) -> None:
    try:
        shutil.move(str(src), dst)
    except OSError:
        pass


def _read_attempts(path: Path) -> list[dict]:
    try:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        rows = []
    path.unlink(missing_ok=True)
    return rows
