"""Stages as Ray tasks: `--executor ray` hands each stage to a Ray cluster instead of this host's scheduler.
The driver plans, reads the cache and writes the run records; each stage to build is one Ray task asking for what the
local scheduler would grant (`RayCluster.request`). On its node the task takes the entry's lock, builds beside the entry
and commits there, so the cache must be storage every node mounts at the same path (ray_probe.py checks). A task whose
node is lost ends uncommitted; Ray runs it again elsewhere (max_retries), and that attempt clears the dead one's folder.

    ray start --head --num-gpus 1 && quantpipe run recipes/*.yaml --executor ray --address auto
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
from concurrent.futures import Future
from pathlib import Path

from . import ray_boot
from .dispatch import RunError
from .ray_probe import check_nodes
from .ray_stages import RayStages, fmt_resource
from .schedule import SHARED

log = logging.getLogger(__name__)


def _loopback(address: str) -> bool:
    return address.rsplit(":", 1)[0] in ("127.0.0.1", "localhost")


class RayCluster:
    """The connection to one Ray cluster, shared by every recipe of a `quantpipe run`."""

    def __init__(self, address: str = "auto", jobs: int | None = None):
        self.address, self.jobs = address, jobs
        self.nodes: dict[str, dict] = {}  # node id -> {"address", "resources", and the probe's findings}
        self.lock = threading.Lock()
        self.inflight: dict[
            tuple[str, str], Future
        ] = {}  # (stage, key) being built by one recipe; the others wait for it
        self.probed = (set(), set(), set())  # caches, environments, stage kinds every node was checked for
        self.stopping = False

    def connect(self) -> RayCluster:
        if _loopback(self.address):  # Ray would dial this host's external address instead of the loopback one given
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        import ray

        addr = self.address if self.address != "auto" else os.environ.get("RAY_ADDRESS", "auto")
        if addr != "auto" and not addr.startswith("ray://"):
            host, _, port = addr.rpartition(":")
            try:
                socket.create_connection((host, int(port)), timeout=5).close()
            except (OSError, ValueError) as e:
                raise RunError(
                    f"--address {self.address}: no Ray cluster answers there ({e}); start one (`ray start --head`) "
                    "or give the address its head printed (HOST:PORT)"
                ) from None
        try:
            ray.init(address=addr, logging_level=logging.WARNING, log_to_driver=False, namespace="quantpipe")
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise RunError(
                f"--address {self.address}: cannot connect to a Ray cluster ({str(e).splitlines()[0][:200]}); start one "
                "(`ray start --head`) or pass --address HOST:PORT"
            ) from None
        self.ray = ray
        ray.cloudpickle.register_pickle_by_value(
            ray_boot
        )  # its code goes with each task: a node needs no quantpipe installed
        self.task = ray.remote(ray_boot.call)
        self.refresh()
        return self

    def refresh(self) -> list[str]:
        """The live nodes' ids; every node seen stays named (a lost one too)."""
        alive = []
        for n in self.ray.nodes():
            d = self.nodes.setdefault(n["NodeID"], {"resources": {}})
            d |= {"address": f"{n['NodeManagerAddress']}:{n['NodeManagerPort']}", "alive": bool(n.get("Alive"))}
            if n.get("Alive"):
                d["resources"] = n.get("Resources", {})
                alive.append(n["NodeID"])
        return alive

    def _live(self) -> list[dict]:
        return [n for n in self.nodes.values() if n.get("alive")]

    def name(self, node_id: str) -> str:
        return f"{self.nodes.get(node_id, {}).get('address', '?')} (node {node_id[:8]})"

    def check(self, caches: list[Path], envs: set[str], kinds: set[str]) -> None:
        """Every node must see each cache, honour its locks, and hold this driver's environments and stage code (ray_probe.py)."""
        check_nodes(self, caches, envs, kinds)

    def gpu_total_bytes(self) -> int | None:
        """The smallest GPU of the nodes that have Ray GPUs and know their size (nvidia-smi, or simulated ones)."""
        sizes = [g["total_bytes"] for n in self._live() if n["resources"].get("GPU") for g in n.get("gpus", [])]
        return min(sizes) if sizes else None

    def request(self, kind: str, est: dict | None, tp: int = 1) -> dict:
        """The Ray resources of one stage: what the local scheduler would grant it, as a Ray request."""
        est = est or {}
        ram = int(est.get("ram_bytes") or 0)
        req: dict = {"num_cpus": 1, "num_gpus": 0}
        if ram:
            req["memory"] = ram
        if not any(n["resources"].get("GPU") for n in self._live()):
            cpus = [int(n["resources"]["CPU"]) for n in self._live() if n["resources"].get("CPU", 0) >= 1]
            req["num_cpus"] = min(
                cpus, default=1
            )  # a whole node, as the local executor runs one stage at a time without GPUs
        elif kind == "benchmark":
            req["num_gpus"] = tp
        elif kind in SHARED:
            need, total = int(est.get("gpu_bytes") or est.get("ram_bytes") or 0), self.gpu_total_bytes()
            req["num_gpus"] = min(1.0, max(0.01, math.ceil(need / total * 100) / 100)) if need and total else 1
        return req

    def infeasible(self, sid: str, req: dict) -> str | None:
        """Why no node could ever run `req` (Ray would queue it forever), else None."""
        keys = {"num_cpus": "CPU", "num_gpus": "GPU", "memory": "memory"}
        for n in self._live():
            if all(n["resources"].get(keys[k], 0) >= v for k, v in req.items() if v):
                return None
        biggest = {r: max((n["resources"].get(r, 0) for n in self._live()), default=0) for r in keys.values()}
        asks = ", ".join(f"{keys[k]} {fmt_resource(keys[k], v)}" for k, v in req.items() if v)
        has = ", ".join(f"{r} {fmt_resource(r, v)}" for r, v in biggest.items())
        return f"{sid} asks Ray for {asks} but no node has that much (the largest offer: {has}); add such a node or lower the stage's needs"

    def claim(self, key: tuple[str, str]) -> tuple[Future, bool]:
        with self.lock:
            if key in self.inflight:
                return self.inflight[key], False
            self.inflight[key] = Future()
            return self.inflight[key], True

    def done(self, key: tuple[str, str]) -> None:
        with self.lock:
            self.inflight.pop(key, None)

    def attach(self, runner) -> RayStages:
        """Make this cluster a runner's executor: its pre-flight, scheduler and processes become the cluster's."""
        stages = RayStages(self, runner)
        runner.procs, runner.scheduler = stages, stages.scheduler
        return stages

    def shutdown(self) -> None:
        if getattr(self, "ray", None) is not None:
            self.ray.shutdown()
