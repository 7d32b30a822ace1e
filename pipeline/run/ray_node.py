"""The node side of `--executor ray`: the task that builds a cache entry where Ray placed it, and the start-up probe.
A task takes the entry's lock (the local runner's too), builds beside the entry and commits, as the local runner does,
and ends its attempt uncommitted if its node's raylet dies. Each node loads it from a checkout at the driver's path.

    ray.remote(ray_boot.call).options(num_gpus=0.25, memory=4 << 30).remote(PACKAGE, "run_stage", job)  # ray_executor.py
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import threading
import time
from pathlib import Path

from filelock import FileLock, Timeout

from ..cache import StageCache
from ..envs import EnvError, hardware_key, lock_hash, python_for, source_hash
from ..stages.contract import Upstream
from .process import Processes, secrets
from .schedule import gpus

WORKER = (
    Path(__file__).resolve().parents[1] / "worker.py"
)  # the node's own checkout: the probe checks it is the driver's code

NODE_DOCS = (
    "start every node from the same image, or run `make setup` in the same checkout path on each (docs/cluster.md)"
)


def _node_problems(job: dict) -> list[str]:
    """What this node lacks of what the driver planned with: the stage environments and the same stage code."""
    out = []
    for env, want in job.get("envs", {}).items():
        try:
            python_for(env)
        except EnvError as e:
            out.append(f"{e}; {NODE_DOCS}")
            continue
        if lock_hash(env) != want:
            out.append(
                f"its {env!r} environment differs from the driver's (another lock file or installed set); {NODE_DOCS}"
            )
    for kind, want in job.get("code", {}).items():
        if source_hash(kind) != want:
            out.append(
                f"its quantpipe code for the {kind} stage differs from the driver's ({Path(__file__).parents[1]}); "
                f"deploy the same checkout to every node ({NODE_DOCS})"
            )
    return out


def probe(job: dict) -> dict:
    """Runs on one node at start: can it see and lock each cache, and does it hold the driver's environments and code."""
    import ray

    from .. import preflight

    nid = ray.get_runtime_context().get_node_id()
    problems, lock_problem = _node_problems(job), None
    for root in job["caches"]:
        d = Path(root) / "tmp" / "ray"
        try:
            if (d / f"probe-{job['token']}").read_text() != job["token"]:
                raise OSError("its content differs")
            (d / f"probe-{job['token']}.{nid}").write_text(job["token"])
        except OSError as e:
            problems.append(
                f"cannot see the stage cache {root} (a probe the driver wrote there: {e}); mount the same storage at "
                "the same path on every node and on the driver, or pass --cache"
            )
            continue
        lock = FileLock(str(d / f"probe-{job['token']}.lock"))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            pass  # the driver holds it, and this node sees that: the cache's locks hold across hosts
        else:
            lock.release()
            lock_problem = (
                f"a lock the driver holds on {root} is free here: its file system's locks are not shared between hosts, so "
                "two runs could build one entry twice; use storage whose flock holds across hosts (docs/cluster.md)"
            )
    return {
        "problems": problems,
        "lock_problem": lock_problem,
        "gpus": [{"index": g.index, "total_bytes": g.total_bytes} for g in gpus()],
        "gpu": preflight.gpu_memory(),
        "ram_bytes": preflight.machine(Path(job["caches"][0]), Path(job["caches"][0]))["ram_bytes"],
        "cpus": os.cpu_count(),
        "hardware": hardware_key(),
    }


def _watch(procs: Processes, work: Path, cancel: Path) -> tuple[threading.Event, threading.Event]:
    """End this attempt uncommitted if the raylet (this worker's parent) dies: Ray reruns the task elsewhere, and a
    worker left behind would write the shared cache beside it. Stop the stage when `cancel` appears (Ctrl-C)."""
    parent, done, lost = os.getppid(), threading.Event(), threading.Event()

    def watch():
        while not done.wait(0.5):
            if os.getppid() != parent:
                lost.set()  # the attempt must not return (it would count as the stage's own failure): it ends here
                procs.signal_all(signal.SIGKILL)
                shutil.rmtree(work, ignore_errors=True)
                os._exit(1)
            if cancel.exists():
                procs.stop_all()
                return

    threading.Thread(target=watch, name="raylet-watch", daemon=True).start()
    return done, lost


def _uncap_threads() -> None:
    """Ray sets OMP_NUM_THREADS to a task's CPU count where its node's environment did not; the local executor lets a
    stage's libraries use every core, and so do tasks: drop Ray's value (one the node was started with stays)."""
    try:
        node_env = Path(f"/proc/{os.environ['RAY_RAYLET_PID']}/environ").read_bytes().split(b"\0")
    except (KeyError, OSError):
        return
    if not any(v.startswith(b"OMP_NUM_THREADS=") for v in node_env):
        os.environ.pop("OMP_NUM_THREADS", None)


def run_stage(job: dict) -> dict:
    """One attempt at one entry where Ray placed it: lock, build in a fresh folder, commit. `job["joint"]`: an
    evaluation built by the same worker under both locks, reported under "joint"; "split": one was built meanwhile."""
    import ray

    nid = ray.get_runtime_context().get_node_id()
    cache = StageCache(Path(job["cache"]))
    jobs = [job, *([job["joint"]] if job.get("joint") else [])]
    locks = []
    try:
        for j in jobs:
            entry = cache.entry(j["stage"], j["key"])
            entry.parent.mkdir(parents=True, exist_ok=True)
            lock = cache.lock(j["stage"], j["key"])
            try:
                lock.acquire(timeout=0)
            except Timeout:
                return {"state": "busy"}
            locks.append(lock)
        markers = [None if j["forced"] else cache.lookup(j["stage"], j["key"]) for j in jobs]
        if len(jobs) > 1 and any(markers):
            return {"state": "split"}
        if markers[0] is not None:
            return {"state": "hit", "marker": markers[0]}
        return _build(job, jobs, cache, nid)
    finally:
        for lock in locks:
            lock.release()


def _build(job: dict, jobs: list[dict], cache: StageCache, nid: str) -> dict:
    import ray

    Path(job["attempts"]).parent.mkdir(parents=True, exist_ok=True)
    with open(job["attempts"], "a") as f:  # on shared storage: the driver reads every attempt, also those of lost nodes
        f.write(
            json.dumps({"node_id": nid, "pid": os.getpid(), "host": socket.gethostname(), "started_at": time.time()})
            + "\n"
        )
    for j in jobs:
        wrong = _node_problems({"envs": {j["env"]: j["expect"]["env"]}, "code": {j["kind"]: j["expect"]["code"]}})
        if wrong:
            return {
                "state": "failed",
                "summary": f"{j['stage']} cannot run on node {socket.gethostname()} ({nid[:8]}): {wrong[0]}",
            }
    works, specs = [], []
    for j in jobs:
        entry = cache.entry(j["stage"], j["key"])
        for old in entry.parent.glob(
            f".{j['key']}.*-*"
        ):  # folders of attempts that died: we hold the lock, nobody else builds it
            if old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
        work = entry.parent / f".{j['key']}.ray-{nid[:12]}-{os.getpid()}-{time.monotonic_ns()}"
        (work / "out").mkdir(parents=True)
        spec = {**j["spec"], "out": str(work / "out"), "metrics": str(work / "metrics.json")}
        if j["kind"] == "package":  # its manifest names the key of the entry it is built into
            spec["upstream"] = {
                **spec["upstream"],
                "self": Upstream(out=work / "out", stage=j["stage"], key=j["key"]).to_json(),
            }
        works.append(work)
        specs.append(spec)
    (works[0] / "spec.json").write_text(
        json.dumps({**specs[0], **({"evaluate": specs[1]} if len(jobs) > 1 else {})}, indent=2, default=str)
    )
    _uncap_threads()
    procs = Processes(cache.root / "tmp", secrets())
    watching, lost = _watch(procs, works[0], Path(job["cancel"]))
    t0 = time.perf_counter()
    try:
        rc = procs.spawn(
            [str(python_for(job["env"])), str(WORKER), str(works[0] / "spec.json")],
            Path(job["log"]),
            job["timeout_s"],
            job["run_env"],
        )
    except BaseException:  # cancelled: the stage was stopped, its half output goes
        for w in works:
            shutil.rmtree(w, ignore_errors=True)
        raise
    finally:
        if lost.is_set():  # the node is gone: this worker exits in a moment, returning nothing
            threading.Event().wait()
        watching.set()
    joint = _commit(cache, jobs[1], works[1], specs[1], None) if len(jobs) > 1 else None
    if rc != 0:
        shutil.rmtree(works[0], ignore_errors=True)
        return {"state": "cancelled" if Path(job["cancel"]).exists() else "failed", "rc": rc, "joint": joint}
    return {
        **_commit(cache, job, works[0], specs[0], t0),
        "node_id": nid,
        "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
        "joint": joint,
    }


def _commit(cache: StageCache, j: dict, work: Path, spec: dict, t0: float | None) -> dict:
    """{"state": "built", "marker"} once `work` is committed; a joint evaluation without a result: {"state": "failed", "summary"}.
    The wall time from `t0`, or (None) the stage's own."""
    if not (work / "metrics.json").exists():
        why = json.loads((work / "failed.json").read_text()) if (work / "failed.json").exists() else {}
        shutil.rmtree(work, ignore_errors=True)
        return {"state": "failed", "summary": why.get("error") or f"{j['stage']} wrote no result (its log says why)"}
    metrics = json.loads((work / "metrics.json").read_text())
    (work / "metrics.json").unlink()
    (work / "spec.json").unlink(missing_ok=True)
    inputs = [spec["src"], *(u["out"] for role, u in spec["upstream"].items() if role != "self")]
    wall = metrics.get("wall_s") if t0 is None else round(time.perf_counter() - t0, 3)
    try:
        marker = cache.commit(work, j["stage"], j["key"], {"metrics": metrics, "wall_s": wall}, inputs=inputs)
    except OSError as e:
        shutil.rmtree(work, ignore_errors=True)
        return {"state": "failed", "summary": f"could not commit the output of {j['stage']} to {cache.root}: {e}"}
    return {"state": "built", "marker": marker}
