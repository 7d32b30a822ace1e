"""Which stages may run now: GPUs and memory handed out from the pre-flight estimates. Pure: no processes.
A benchmark has its GPUs to itself (without GPUs, the host), or its figures are not worth publishing; one whose
engines all set `kv_cache_memory_bytes` shares its GPU outside its measured runs, and once it waits to measure nothing
new starts there, or a stream of other work could hold it off. Quantize and evaluate pack onto the busiest GPU they fit,
keeping the others idle for benchmarks. A host without GPUs and `jobs` > 1 is shared like one GPU. One stage may always
start when nothing runs (pre-flight refused any that fits nowhere). In full: docs/architecture.md, "Scheduling".

    sched = Scheduler(gpus("0,1"), ram_bytes=64 << 30, jobs=4)
    grant = sched.try_start("quantize:awq", "quantize", est)   # -> Grant(gpus=["0"]) or None
    sched.finish("quantize:awq")
    sched.try_start("benchmark:fp8", "benchmark", est, share=True)   # a shared grant
    sched.wait_to_measure("benchmark:fp8"); sched.try_measure("benchmark:fp8")   # -> True when the GPU is its alone
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

from ..common.nvidia import nvidia_smi, visible_gpus

GIB = 2**30
EXCLUSIVE = {"benchmark"}
SHARED = {"quantize", "evaluate"}


@dataclass(frozen=True)
class Gpu:
    index: str
    total_bytes: int  # what the run may use of it: the card's memory, or less under --gpu-memory
    name: str = ""
    card_bytes: int = 0  # the card's own memory (0: as total_bytes)


@dataclass
class Grant:
    gpus: list[str]
    gpu_bytes: int = 0
    ram_bytes: int = 0
    exclusive: bool = False
    phase: str = "busy"  # a shared benchmark: "waiting" (to measure: idle on its GPU) or "measuring"
    gate: str | None = None  # a shared benchmark: the folder its worker and the runner meet in (common/measure_gate.py)
    windows: list = field(default_factory=list)  # [start_s, end_s] of each stretch it measured
    asked: int = 0  # a shared benchmark waiting to measure: its place in the queue (the earliest measures first)
    cpu_shared: bool = False  # on a shared host: the stage's OpenMP threads sleep rather than spin while they wait


def gpus(select: str | None = None, cap_bytes: int | None = None) -> list[Gpu]:
    """The GPUs a run may use: nvidia-smi's (within CUDA_VISIBLE_DEVICES), or `QUANTPIPE_GPUS` simulated ones
    (`2` for two of 80 GiB, `2x24` for two of 24 GiB) for a CPU host; `select` ("0,1", --gpus) narrows them;
    `cap_bytes` (--gpu-memory) is the most the run uses of each."""
    found = _gpus(select)
    if cap_bytes:
        found = [Gpu(g.index, min(g.total_bytes, cap_bytes), g.name, g.total_bytes) for g in found]
    return found


def free_bytes(gpu: Gpu) -> int | None:
    """The memory free on `gpu` now as nvidia-smi sees it, less what --gpu-memory leaves to others (None: simulated, or
    nvidia-smi does not answer)."""
    if gpu.name == "simulated":
        return None
    rows = nvidia_smi("--query-gpu=memory.free", "--format=csv,noheader,nounits", "-i", gpu.index)
    try:
        free = int(float(rows[0][0])) * 2**20
    except (ValueError, IndexError):
        return None
    return free - ((gpu.card_bytes or gpu.total_bytes) - gpu.total_bytes)


def _gpus(select: str | None) -> list[Gpu]:
    sim = os.environ.get("QUANTPIPE_GPUS", "").strip()
    if sim:
        n, _, gib = sim.partition("x")
        found = [Gpu(str(i), int(float(gib or 80) * GIB), "simulated") for i in range(int(n))]
    else:
        rows = nvidia_smi("--query-gpu=index,memory.total,name", "--format=csv,noheader,nounits")
        try:
            found = [Gpu(i, int(float(mib)) * 2**20, ", ".join([name, *rest])) for i, mib, name, *rest in rows]
        except ValueError:
            found = []
        visible = visible_gpus()
        if visible is not None:
            found = [g for g in found if g.index in visible]
    if select:
        wanted = [s.strip() for s in select.split(",") if s.strip()]
        unknown = [w for w in wanted if w not in {g.index for g in found}]
        if unknown:
            have = ", ".join(g.index for g in found) or "none"
            raise ValueError(f"--gpus: no GPU {', '.join(unknown)} on this host (GPUs here: {have})")
        found = [g for g in found if g.index in wanted]
    return found


def shares_gpu(bench, on_gpu: bool) -> bool:
    """Its KV cache is sized by `kv_cache_memory_bytes` (variants inherit it), not by free GPU memory at start-up: the
    recipe's, or on a GPU host, where the engine sets no gpu_memory_utilization either, the one quantpipe picks."""
    e = bench.engine
    return e.kv_cache_memory_bytes is not None or (on_gpu and e.gpu_memory_utilization is None)


def default_jobs(n_gpus: int) -> int:
    """Without GPUs one stage at a time (CPU stages take every core); with GPUs four per GPU at most."""
    return 4 * n_gpus if n_gpus else 1


@dataclass
class Scheduler:
    gpus: list[Gpu]
    ram_bytes: int | None = None
    jobs: int = 1
    running: dict[str, Grant] = field(default_factory=dict)
    asks: int = 0  # requests to measure so far
    # the memory free on a GPU now (schedule.free_bytes; None: unknown): a stage that shares a GPU starts only where
    # its grant fits what is really free, not only what the grants leave, since other processes use GPUs too
    free_probe: Callable[[Gpu], int | None] | None = None

    def _users(self, index: str | None) -> list[Grant]:
        """The grants on GPU `index`; None: on the host (a host without GPUs is one device to share)."""
        return [g for g in self.running.values() if index is None or index in g.gpus]

    def _held(self, index: str | None) -> bool:
        """A benchmark on this GPU (or host) waits to measure or measures: nothing new starts there."""
        return any(g.phase in ("waiting", "measuring") for g in self._users(index))

    def _free_bytes(self, gpu: Gpu) -> int:
        return gpu.total_bytes - sum(g.gpu_bytes for g in self._users(gpu.index))

    def try_start(self, sid: str, kind: str, est: dict | None, n_gpus: int = 1, share: bool = False) -> Grant | None:
        """A grant if `sid` may start now, else None; `share`: a benchmark that may share its GPU (module docstring)."""
        est = est or {}
        ram = int(est.get("ram_bytes") or 0)
        if len(self.running) >= max(1, self.jobs):
            return None
        if (
            self.running
            and self.ram_bytes is not None
            and sum(g.ram_bytes for g in self.running.values()) + ram > self.ram_bytes
        ):
            return None
        on_host = not self.gpus and self.jobs > 1  # the host shared like one GPU
        if kind in EXCLUSIVE and not (share and n_gpus == 1 and (self.gpus or on_host)):
            return self._exclusive(sid, ram, n_gpus)
        if any(g.exclusive and not g.gpus for g in self.running.values()):
            return None  # a benchmark on a host without GPUs runs alone
        if on_host and self._held(None):
            return None
        if (kind in SHARED or share) and self.gpus:
            need = int(est.get("gpu_bytes") or est.get("ram_bytes") or 0)
            fits = [
                g
                for g in self.gpus
                if not any(u.exclusive for u in self._users(g.index))
                and not self._held(g.index)
                and (not self._users(g.index) or (self._free_bytes(g) >= need and self._really_free(g, need)))
            ]
            if not fits:
                return None
            if share:  # a benchmark: the idlest GPU, so that its measurement waits the least
                gpu = min(fits, key=lambda g: (len(self._users(g.index)), -self._free_bytes(g)))
            else:  # the busiest GPU it fits
                gpu = min(fits, key=lambda g: (not self._users(g.index), self._free_bytes(g)))
            return self._grant(sid, Grant([gpu.index], need, ram))
        return self._grant(sid, Grant([], 0, ram, cpu_shared=on_host and kind not in EXCLUSIVE))

    def _really_free(self, gpu: Gpu, need: int) -> bool:
        free = self.free_probe(gpu) if self.free_probe is not None else None
        return free is None or free >= need

    def wait_to_measure(self, sid: str) -> None:
        """`sid` (a shared benchmark) is ready to measure: idle on its GPU until `try_measure` lets it."""
        g = self.running[sid]
        if g.phase != "waiting":
            self.asks += 1
            g.phase, g.asked = "waiting", self.asks

    def try_measure(self, sid: str) -> bool:
        """True, and `sid` measures, when every other stage on its GPU waits to measure and none of them asked first."""
        if self.blockers(sid):
            return False
        self.running[sid].phase = "measuring"
        return True

    def blockers(self, sid: str) -> list[str]:
        """The stages that keep `sid` from measuring: those on its GPU that work, or wait to measure and asked first."""
        g = self.running[sid]
        return sorted(o for o, u in self._beside(sid).items() if u.phase != "waiting" or u.asked < g.asked)

    def _beside(self, sid: str) -> dict[str, Grant]:
        """The other stages on `sid`'s GPUs (on a host without GPUs, every other stage)."""
        g = self.running[sid]
        return {
            other: u for other, u in self.running.items() if u is not g and (not self.gpus or set(u.gpus) & set(g.gpus))
        }

    def end_measure(self, sid: str) -> None:
        self.running[sid].phase = "busy"

    def _exclusive(self, sid: str, ram: int, n_gpus: int) -> Grant | None:
        if not self.gpus:
            return self._grant(sid, Grant([], 0, ram, exclusive=True)) if not self.running else None
        idle = [g for g in self.gpus if not self._users(g.index)]
        if len(idle) < n_gpus:
            return None
        take = idle[:n_gpus]
        return self._grant(sid, Grant([g.index for g in take], sum(g.total_bytes for g in take), ram, exclusive=True))

    def _grant(self, sid: str, grant: Grant) -> Grant:
        self.running[sid] = grant
        return grant

    def finish(self, sid: str) -> None:
        self.running.pop(sid, None)
