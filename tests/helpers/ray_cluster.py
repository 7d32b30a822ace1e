"""A real Ray cluster on this host for the Ray executor's tests and bench/bench_ray_overhead.py: a head and more
nodes on 127.0.0.1, every process it starts carrying a marker in its environment, stopped by pid."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import psutil

MARK = "QUANTPIPE_RAY_TEST"


def marked(mark: str) -> list[psutil.Process]:
    """Live processes whose environment carries `mark` (read raw: psutil's parse loses it where Ray set a process title)."""
    out, needle = [], f"{MARK}={mark}".encode()
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if (
                p.info["status"] != psutil.STATUS_ZOMBIE
                and p.pid != os.getpid()
                and needle in Path(f"/proc/{p.pid}/environ").read_bytes().split(b"\0")
            ):
                out.append(p)
        except (psutil.Error, OSError):
            pass
    return out


@contextlib.contextmanager
def ray_cluster(nodes: int, system: dict | None = None, **node):
    """A head and nodes-1 more nodes on 127.0.0.1 (Ray's files in a short folder under /tmp); stopped by pid, then
    anything still carrying this cluster's marker (Ray's workers and agents outlive their raylet briefly) killed by pid."""
    from ray.cluster_utils import Cluster

    tmp = tempfile.mkdtemp(prefix="qpray-", dir="/tmp")  # Ray's socket paths must stay short
    mark = uuid.uuid4().hex
    saved = {k: os.environ.get(k) for k in ("RAY_TMPDIR", MARK, "QUANTPIPE_GPUS")}
    os.environ.update({"RAY_TMPDIR": tmp, MARK: mark, **({"QUANTPIPE_GPUS": "1x24"} if node.get("num_gpus") else {})})
    node = {"node_ip_address": "127.0.0.1", "object_store_memory": 80 << 20, **node}
    fast = {
        "health_check_period_ms": 1000,
        "health_check_failure_threshold": 3,
        **(system or {}),
    }  # a lost node is dead in seconds
    c = Cluster(
        initialize_head=True,
        shutdown_at_exit=False,
        head_node_args={**node, "include_dashboard": False, "_system_config": fast},
    )
    try:
        more = [c.add_node(**node) for _ in range(nodes - 1)]
        yield SimpleNamespace(
            cluster=c, address=c.address, head=c.head_node, second=more[0] if more else None, node=node, mark=mark
        )
    finally:
        for n in [*c.worker_nodes, c.head_node]:
            if n is not None:
                n.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)
        deadline, quiet = time.monotonic() + 30, 0
        while quiet < 10:  # until none shows for 5 s: Ray's agents can outlive their raylet, ignoring SIGTERM
            left = marked(mark)
            quiet = 0 if left else quiet + 1
            for p in left:
                try:
                    if (
                        p.ppid() == 1 or time.monotonic() > deadline
                    ):  # orphaned, or still there after 30 s: killed by pid
                        p.kill()
                except psutil.Error:
                    pass
            time.sleep(0.5)
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        shutil.rmtree(tmp, ignore_errors=True)
        assert not [p for p in marked(mark) if p.is_running()], "Ray processes outlived the test cluster"
