"""How a benchmark that shares its GPU (run/schedule.py) gets the GPU to itself for what it measures. The runner hands the
stage's worker a folder in `QUANTPIPE_MEASURE_GATE`; before each measured stretch (a server's warm-up and runs, the
offline benchmarks) the stage creates `want-N` and waits for `go-N`, which the runner creates once every other stage on
that GPU is idle, and the runner starts nothing there until the stage creates `done-N`. Without the variable (a GPU of
its own, a host without GPUs, a stage run by hand) `measuring()` goes on at once. Folder names carry the runner's pid,
so that the next run removes those of a runner that died.

    with measuring() as gate:  # gate["waited_s"]: how long it waited for the GPU
        ...
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ENV = "QUANTPIPE_MEASURE_GATE"
PREFIX = "measure-gate-"
_requests = itertools.count(1)


@contextmanager
def measuring(poll_s: float = 0.2):
    gate = {"shared_gpu": bool(os.environ.get(ENV)), "waited_s": 0.0}
    if not gate["shared_gpu"]:
        yield gate
        return
    folder, n = Path(os.environ[ENV]), next(_requests)
    (folder / f"want-{n}").touch()
    t0 = time.monotonic()
    while not (folder / f"go-{n}").exists():
        time.sleep(poll_s)
    gate["waited_s"] = round(time.monotonic() - t0, 2)
    try:
        yield gate
    finally:
        (folder / f"done-{n}").touch()


def latest(folder: str | Path) -> tuple[int, str]:
    """The stage's latest request in `folder` and how far it got."""
    names = {p.name for p in Path(folder).iterdir()} if Path(folder).is_dir() else set()
    n = max((int(x.split("-")[1]) for x in names if x.startswith("want-")), default=0)
    if not n:
        return 0, ""
    return n, "done" if f"done-{n}" in names else "go" if f"go-{n}" in names else "want"


def grant(folder: str | Path, n: int) -> None:
    (Path(folder) / f"go-{n}").touch()


def new_folder(tmpdir: str | Path) -> str:
    """A folder in `tmpdir` for one shared benchmark and this runner."""
    return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=tmpdir)


def sweep(tmpdir: str | Path) -> None:
    """Remove the folders in `tmpdir` of runners that died (their pid is gone)."""
    from ..cache import alive

    for p in Path(tmpdir).glob(f"{PREFIX}*"):
        pid = p.name[len(PREFIX) :].split("-")[0]
        if pid.isdigit() and p.is_dir() and not alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)
