"""The node side of `--executor ray`: the task that builds one cache entry where Ray placed it, and the start-up probe.

A task takes the entry's lock (the same one the local runner takes), builds in a fresh working folder beside the
entry and commits it, as the local runner does; it ends its attempt uncommitted if its node's raylet dies.
Imported by Ray's workers on every node (by reference: the same checkout must be there; the probe checks it).

    ray.remote(run_stage).options(num_gpus=0.25, memory=4 << 30).remote(job)   # run/ray_executor.py builds `job`
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

WORKER = Path(__file__).resolve().parents[1] / "worker.py"  # the node's own checkout: the probe checks it is the driver's code

NODE_DOCS = "start every node from the same image, or run `make setup` in the same checkout path on each (docs/cluster.md)"


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
            out.append(f"its {env!r} environment differs from the driver's (another lock file or installed set); {NODE_DOCS}")
    for kind, want in job.get("code", {}).items():
        if source_hash(kind) != want:
            out.append(f"its quantpipe code for the {kind} stage differs from the driver's ({Path(__file__).parents[1]}); "
                       f"deploy the same checkout to every node ({NODE_DOCS})")
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
            problems.append(f"cannot see the stage cache {root} (a probe the driver wrote there: {e}); mount the same storage at "
                            "the same path on every node and on the driver, or pass --cache")
            continue
        lock = FileLock(str(d / f"probe-{job['token']}.lock"))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            pass  # the driver holds it, and this node sees that: the cache's locks hold across hosts
        else:
            lock.release()
            lock_problem = (f"a lock the driver holds on {root} is free here: its file system's locks are not shared between hosts, so "
                            "two runs could build one entry twice; use storage whose flock holds across hosts (docs/cluster.md)")
    return {"problems": problems, "lock_problem": lock_problem, "gpus": [{"index": g.index, "total_bytes": g.total_bytes} for g in gpus()],
            "gpu": preflight.gpu_memory(), "ram_bytes": preflight.machine(Path(job["caches"][0]), Path(job["caches"][0]))["ram_bytes"],
            "cpus": os.cpu_count(), "hardware": hardware_key()}


def _watch(procs: Processes, work: Path, cancel: Path) -> tuple[threading.Event, threading.Event]:
    """End this attempt, uncommitted, if the node's raylet (this worker's parent) dies: Ray counts the node lost and runs
    the task elsewhere, while a worker left behind would go on writing the shared cache beside the new attempt. Stop the
    stage when the driver asks (`cancel` appears: Ctrl-C), so that the attempt ends failed and cleans up after itself."""
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
    """One attempt at one entry, on the node Ray chose: lock, build in a fresh folder, commit; the same as the local runner."""
    import ray

    nid = ray.get_runtime_context().get_node_id()
    cache, stage, key = StageCache(Path(job["cache"])), job["stage"], job["key"]
    entry = cache.entry(stage, key)
    entry.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(entry) + ".lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return {"state": "busy"}
    try:
        marker = None if job["forced"] else cache.lookup(stage, key)
        if marker is not None:
            return {"state": "hit", "marker": marker}
        Path(job["attempts"]).parent.mkdir(parents=True, exist_ok=True)
        with open(job["attempts"], "a") as f:  # on shared storage: the driver reads every attempt, also those of lost nodes
            f.write(json.dumps({"node_id": nid, "pid": os.getpid(), "host": socket.gethostname(), "started_at": time.time()}) + "\n")
        wrong = _node_problems({"envs": {job["env"]: job["expect"]["env"]}, "code": {job["kind"]: job["expect"]["code"]}})
        if wrong:
            return {"state": "failed", "summary": f"{stage} cannot run on node {socket.gethostname()} ({nid[:8]}): {wrong[0]}"}
        for old in entry.parent.glob(f".{key}.*-*"):  # folders of attempts that died: we hold the lock, nobody else builds it
            if old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
        work = entry.parent / f".{key}.ray-{nid[:12]}-{os.getpid()}-{time.monotonic_ns()}"
        (work / "out").mkdir(parents=True)
        spec = {**job["spec"], "out": str(work / "out"), "metrics": str(work / "metrics.json")}
        if job["kind"] == "package":  # its manifest names the key of the entry it is built into
            spec["upstream"] = {**spec["upstream"], "self": Upstream(out=work / "out", stage=stage, key=key).to_json()}
        (work / "spec.json").write_text(json.dumps(spec, indent=2, default=str))
        _uncap_threads()
        procs = Processes(cache.root / "tmp", secrets())
        watching, lost = _watch(procs, work, Path(job["cancel"]))
        t0 = time.perf_counter()
        try:
            rc = procs.spawn([str(python_for(job["env"])), str(WORKER), str(work / "spec.json")], Path(job["log"]), job["timeout_s"], job["run_env"])
        except BaseException:  # cancelled: the stage was stopped, its half output goes
            shutil.rmtree(work, ignore_errors=True)
            raise
        finally:
            if lost.is_set():  # the node is gone: this worker exits in a moment, returning nothing
                threading.Event().wait()
            watching.set()
        if rc != 0:
            shutil.rmtree(work, ignore_errors=True)
            return {"state": "cancelled" if Path(job["cancel"]).exists() else "failed", "rc": rc}
        metrics = json.loads((work / "metrics.json").read_text())
        (work / "metrics.json").unlink()
        (work / "spec.json").unlink()
        inputs = [spec["src"], *(u["out"] for role, u in spec["upstream"].items() if role != "self")]
        try:
            marker = cache.commit(work, stage, key, {"metrics": metrics, "wall_s": round(time.perf_counter() - t0, 3)}, inputs=inputs)
        except OSError as e:
            shutil.rmtree(work, ignore_errors=True)
            return {"state": "failed", "summary": f"could not commit the output of {stage} to {cache.root}: {e}"}
        return {"state": "built", "marker": marker, "node_id": nid, "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}
    finally:
        lock.release()
