"""The driver's start-up check of a Ray cluster, before anything is written: a probe task per node (ray_node.probe).
A node that cannot see each stage cache, honour its locks, or match the driver's environments and stage code is refused.

    check_nodes(cluster, [cache_root], {"quantize", "serve"}, {"merge", "quantize"})   # RunError naming the node
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

from filelock import FileLock

from ..envs import hardware_key, lock_hash, source_hash
from .dispatch import RunError

log = logging.getLogger("quantpipe.run.ray_executor")
PROBE_TIMEOUT_S = 120
PACKAGE = str(
    Path(__file__).resolve().parents[1]
)  # this checkout's quantpipe: each node loads the one at the same path


def check_nodes(c, caches: list[Path], envs: set[str], kinds: set[str]) -> None:
    """Probe every node for these caches, environments and stage kinds (a probe file each way), unless done already."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    want = ({str(x) for x in caches}, set(envs), set(kinds))
    if all(w <= p for w, p in zip(want, c.probed)):
        return
    caches, envs, kinds = [Path(x) for x in sorted(want[0] | c.probed[0])], want[1] | c.probed[1], want[2] | c.probed[2]
    token = uuid.uuid4().hex
    held, probes = [], {}
    try:
        for root in caches:
            d = Path(root) / "tmp" / "ray"
            d.mkdir(parents=True, exist_ok=True)
            (d / f"probe-{token}").write_text(token)
            lock = FileLock(str(d / f"probe-{token}.lock"))
            lock.acquire()
            held.append(lock)
        job = {
            "caches": [str(x) for x in caches],
            "token": token,
            "envs": {e: lock_hash(e) for e in envs},
            "code": {k: source_hash(k) for k in kinds},
        }
        refs = {
            c.task.options(
                num_cpus=0, max_retries=0, scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False)
            ).remote(PACKAGE, "probe", job): nid
            for nid in c.refresh()
        }
        ready, late = c.ray.wait(list(refs), num_returns=len(refs), timeout=PROBE_TIMEOUT_S)
        problems = [
            f"node {c.name(refs[r])} did not answer a probe task within {PROBE_TIMEOUT_S} s; check that node (`ray status`)"
            for r in late
        ]
        for r in ready:
            nid = refs[r]
            try:
                found = c.ray.get(r)
            except c.ray.exceptions.RayError as e:
                problems.append(f"node {c.name(nid)}: the probe task failed ({str(e).splitlines()[0][:200]})")
                continue
            probes[nid] = found
            problems += [f"node {c.name(nid)}: {p}" for p in found["problems"]]
            if (
                found["lock_problem"] and os.environ.get("QUANTPIPE_CACHE_LOCKS") == "per-host"
            ):  # the user runs one driver per cache
                log.warning(
                    "node %s: %s (QUANTPIPE_CACHE_LOCKS=per-host: going on)", c.name(nid), found["lock_problem"]
                )
            elif found["lock_problem"]:
                problems.append(f"node {c.name(nid)}: {found['lock_problem']}")
            for root in caches:
                seen = Path(root) / "tmp" / "ray" / f"probe-{token}.{nid}"
                if not found["problems"] and (not seen.is_file() or seen.read_text() != token):
                    problems.append(
                        f"node {c.name(nid)}: a probe it wrote into the stage cache {root} is not visible here; "
                        "mount the same storage at the same path on every node and on this driver, or pass --cache"
                    )
        if problems:
            raise RunError("--executor ray: " + "; ".join(problems[:1]) + "".join(f"\n  - {p}" for p in problems[1:]))
    finally:
        for lock in held:
            lock.release()
        for root in caches:
            for p in (Path(root) / "tmp" / "ray").glob(f"probe-{token}*"):
                p.unlink(missing_ok=True)
    for nid, found in probes.items():
        c.nodes[nid] |= {k: found[k] for k in ("gpus", "gpu", "ram_bytes", "cpus", "hardware")}
    other = sorted(
        {
            c.name(i)
            for i, n in c.nodes.items()
            if n.get("alive") and n["resources"].get("GPU") and n.get("hardware") != hardware_key()
        }
    )
    if "benchmark" in kinds and other:
        log.warning(
            "benchmark keys and records describe this driver's host, but benchmarks run on %s, whose hardware differs; "
            "run quantpipe on a node like them so that a benchmark is never reused across hardware (docs/cluster.md)",
            ", ".join(other),
        )
    c.probed = ({str(x) for x in caches}, set(envs), set(kinds))
