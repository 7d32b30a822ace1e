"""Building stage entries for the runner: one stage's worker, or an evaluation and its benchmark from one worker.
In a joint job (`build_joint`) the benchmark's server, once healthy, answers the evaluation (vLLM's OpenAI API) and is
then measured; each stage keeps its own key and entry, so changing only `benchmark:` redoes the benchmark alone.

    builder = Builder(runner)
    marker = builder.build(step, base_dir, run_dir, grant)
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

from ..common import measure_gate
from ..common.vllm_support import GPU_BYTES_ENV
from ..deadline import past_deadline
from ..envs import python_for
from ..stages.contract import Upstream
from .plan import Step
from .process import exit_reason, tail
from .schedule import Grant

WORKER = Path(__file__).resolve().parent.parent / "worker.py"


class StageFailed(Exception):
    """A stage that did not commit; `fault`: it failed for a reason of the host (quantpipe.stages.HostFault)."""

    def __init__(self, summary: str, log_path: Path, tail: str, fault: bool = False):
        super().__init__(summary)
        self.summary, self.log_path, self.tail, self.fault = summary, log_path, tail, fault


def _failed_json(work: Path) -> dict:
    """What the worker wrote of a failure in `work` ({} when it wrote nothing: killed, or never started)."""
    try:
        return json.loads((work / "failed.json").read_text())
    except (OSError, ValueError):
        return {}


class Builder:
    """Builds entries of `runner`'s cache from its records (upstream outputs), with its processes and console."""

    def __init__(self, runner):
        self.r = runner

    def build_locked(
        self, s: Step, base_dir: str, run_dir: Path, grant: Grant, forced: bool, state: str
    ) -> tuple[dict, str]:
        """Under the entry's lock: another run may be building the same entry; wait, then reuse it."""
        self.r.cache.entry(s.id, s.key).parent.mkdir(parents=True, exist_ok=True)
        with self.r.cache.lock(s.id, s.key):
            marker = None if forced else self.r.cache.lookup(s.id, s.key)
            return (marker, "hit") if marker is not None else (self.build(s, base_dir, run_dir, grant), state)

    def build(self, s: Step, base_dir: str, run_dir: Path, grant: Grant) -> dict:
        work = self.r.cache.begin(s.id, s.key)
        spec, src, upstream = self._spec(s, base_dir, work)
        log_path = run_dir / "logs" / f"{s.id.replace(':', '_')}.log"
        on = f" on GPU {','.join(grant.gpus)}" if grant.gpus else ""
        self.r.say(f"  [cyan]>[/cyan] {s.id:<24} running in the {s.env} environment{on} (log: {log_path})")
        t0 = time.perf_counter()
        rc = self._spawn(s, spec, [work], log_path, grant)
        if rc != 0:
            why = _failed_json(work)
            shutil.rmtree(work, ignore_errors=True)
            raise self._failure(s, rc, log_path, fault=why.get("fault", False))
        return self._commit(s, work, src, upstream, t0, log_path)

    def build_joint_locked(
        self, e: Step, b: Step, base_dir: str, run_dir: Path, grant: Grant, forced: dict, state: dict, on_eval=None
    ) -> dict:
        """Under both locks, evaluation `e` and benchmark `b` as one job ({stage id: (marker, state) or StageFailed}),
        or each alone where another run built one meanwhile. `on_eval` gets the evaluation's result once committed."""
        for s in (b, e):
            self.r.cache.entry(s.id, s.key).parent.mkdir(parents=True, exist_ok=True)
        with (
            self.r.cache.lock(b.id, b.key),
            self.r.cache.lock(e.id, e.key),
        ):
            have = {s.id: None if forced[s.id] else self.r.cache.lookup(s.id, s.key) for s in (e, b)}
            if not any(have.values()):
                return self.build_joint(e, b, base_dir, run_dir, grant, state, on_eval)
            built: dict[str, object] = {}
            for s in (e, b):
                try:
                    built[s.id] = (
                        (have[s.id], "hit") if have[s.id] else (self.build(s, base_dir, run_dir, grant), state[s.id])
                    )
                except StageFailed as exc:
                    built[s.id] = exc
            return built

    def build_joint(
        self, e: Step, b: Step, base_dir: str, run_dir: Path, grant: Grant, state: dict, on_eval=None
    ) -> dict:
        works = {s.id: self.r.cache.begin(s.id, s.key) for s in (e, b)}
        (spec_e, src, up_e), (spec_b, _, up_b) = (
            self._spec(e, base_dir, works[e.id]),
            self._spec(b, base_dir, works[b.id]),
        )
        log_path = run_dir / "logs" / f"{b.id.replace(':', '_')}.log"
        on = f" on GPU {','.join(grant.gpus)}" if grant.gpus else ""
        self.r.say(f"  [cyan]>[/cyan] {e.id} + {b.id}: one server in the {b.env} environment{on} (log: {log_path})")
        t0 = time.perf_counter()
        built: dict[str, object] = {}
        ew = works[e.id]
        ended = threading.Event()

        def watch() -> None:  # the evaluation is committed the moment the worker writes its metrics
            while not ended.wait(0.5):
                if (ew / "metrics.json").exists():
                    try:
                        built[e.id] = (self._commit(e, ew, src, up_e, None, log_path), state[e.id])
                    except StageFailed as exc:
                        built[e.id] = exc
                    if on_eval is not None:
                        on_eval(built[e.id])
                    return

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            rc = self._spawn(b, {**spec_b, "evaluate": spec_e}, list(works.values()), log_path, grant)
        finally:
            ended.set()
            watcher.join()
        if e.id not in built:
            try:
                if (ew / "metrics.json").exists():
                    built[e.id] = (self._commit(e, ew, src, up_e, None, log_path), state[e.id])
                else:
                    why = _failed_json(ew) or {"rc": rc, "error": None}
                    built[e.id] = self._failure(e, why["rc"], log_path, why["error"], why.get("fault", False))
            except StageFailed as exc:
                built[e.id] = exc
            finally:
                shutil.rmtree(ew, ignore_errors=True)
        try:
            if rc != 0:
                raise self._failure(b, rc, log_path, fault=_failed_json(works[b.id]).get("fault", False))
            built[b.id] = (self._commit(b, works[b.id], src, up_b, t0, log_path), state[b.id])
        except StageFailed as exc:
            built[b.id] = exc
        finally:
            shutil.rmtree(works[b.id], ignore_errors=True)
        return built

    def _spec(self, s: Step, base_dir: str, work: Path) -> tuple[dict, str, dict]:
        """The worker's spec of `s` building in `work`, its input folder and upstream records."""
        src = base_dir if s.src == "external" else str(self.r.records[s.src].out)
        upstream = {role: self.r.records[sid] for role, sid in s.refs.items() if sid in self.r.records}
        if s.kind == "package":  # its manifest names the key of the entry it is built into
            upstream["self"] = Upstream(out=work / "out", stage=s.id, key=s.key)
        spec = {
            "stage": s.id,
            "kind": s.kind,
            "input": s.inp.model_dump(mode="json"),
            "src": src,
            "out": str(work / "out"),
            "upstream": {role: u.to_json() for role, u in upstream.items()},
            "metrics": str(work / "metrics.json"),
        }
        return spec, src, upstream

    def _spawn(self, s: Step, spec: dict, works: list[Path], log_path: Path, grant: Grant) -> int | None:
        """The worker on `spec` (written to the last working folder); on Ctrl-C or SIGTERM every working folder goes."""
        (works[-1] / "spec.json").write_text(json.dumps(spec, indent=2, default=str))
        try:
            env = {"CUDA_VISIBLE_DEVICES": ",".join(grant.gpus)} if grant.gpus else {}
            if grant.gpus and grant.gpu_bytes and not grant.exclusive:  # what its server may take at start-up
                env[GPU_BYTES_ENV] = str(grant.gpu_bytes)
            if grant.gate:
                env[measure_gate.ENV] = grant.gate
            if grant.cpu_shared and "OMP_WAIT_POLICY" not in os.environ:
                env["OMP_WAIT_POLICY"] = "PASSIVE"
            waiting = (
                (lambda gate=grant.gate: measure_gate.latest(gate)[1] == "want") if grant.gate else None
            )  # not counted
            return self.r.procs.spawn(
                [str(python_for(s.env)), str(WORKER), str(works[-1] / "spec.json")],
                log_path,
                self.r.deadline_s(s.id),
                env,
                paused=waiting,
            )
        except BaseException:  # the stage was stopped, its half output goes
            for w in works:
                shutil.rmtree(w, ignore_errors=True)
            raise

    def _failure(
        self, s: Step, rc: int | None, log_path: Path, error: str | None = None, fault: bool = False
    ) -> StageFailed:
        last = tail(log_path)
        if rc is None:  # ran past its deadline and was stopped
            return StageFailed(
                past_deadline(s.id, self.r.deadline_s(s.id), self.r.stage_timeout_s is not None, log_path),
                log_path,
                last,
            )
        err = [ln for ln in last.splitlines() if ln.startswith("STAGE_ERROR: ")]
        summary = error or (
            err[-1].removeprefix("STAGE_ERROR: ") if err else f"{exit_reason(rc)}; last lines of {log_path}:\n{last}"
        )
        return StageFailed(summary, log_path, last, fault)

    def _commit(self, s: Step, work: Path, src: str, upstream: dict, t0: float | None, log_path: Path) -> dict:
        """Commit `work` as the entry of `s`; its wall time from `t0`, or (None) the stage's own (a joint job's evaluation)."""
        metrics = json.loads((work / "metrics.json").read_text())
        (work / "metrics.json").unlink()
        (work / "spec.json").unlink(missing_ok=True)
        wall = metrics.get("wall_s") if t0 is None else round(time.perf_counter() - t0, 3)
        try:
            return self.r.cache.commit(
                work,
                s.id,
                s.key,
                {"metrics": metrics, "wall_s": wall},
                inputs=[src, *(str(u.out) for role, u in upstream.items() if role != "self")],
            )
        except OSError as e:
            shutil.rmtree(work, ignore_errors=True)
            raise StageFailed(
                f"could not commit the output of {s.id} to {self.r.cache.root}: {e}", log_path, ""
            ) from None
