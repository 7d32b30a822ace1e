"""Runs one stage inside its environment; started by the runner as a subprocess.

    <env>/bin/python <repo>/pipeline/worker.py SPEC.json

Started by file path, it loads quantpipe from its own folder, so a stage environment needs quantpipe's light dependencies
only. The spec names the stage, its typed input (its slice of the recipe), the input and output folders and the records
of its upstream stages; the stage's metrics (plus wall time and peak memory) go to `metrics.json` next to the spec.
Exit 0: done; 2: the stage refused its input (a StageError, message on the last line); 1: crashed. A benchmark spec may
carry the artifact's evaluate spec under "evaluate" (a joint job, see quantpipe.run.build): the evaluation then runs
against the benchmark's server before its sweep.
"""

from __future__ import annotations

import errno
import importlib
import importlib.util
import json
import os
import resource
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path


def _bootstrap() -> None:
    """Make `import quantpipe` load this folder, whatever the environment has installed."""
    pkg = Path(__file__).resolve().parent
    if "quantpipe" in sys.modules and Path(sys.modules["quantpipe"].__file__).resolve().parent == pkg:
        return
    spec = importlib.util.spec_from_file_location(
        "quantpipe", pkg / "__init__.py", submodule_search_locations=[str(pkg)]
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["quantpipe"] = mod
    spec.loader.exec_module(mod)


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM us when the runner dies (even by kill -9); SIGTERM then ends our group."""

    def stop(signum, frame):
        try:
            os.killpg(os.getpgrp(), signal.SIGKILL)  # the stage's own children (a vLLM server) too
        finally:
            os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)  # first: a death signal that comes early must end the group too
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    # The runner died before prctl took effect: we were re-parented (to init or a subreaper).
    runner = os.environ.get("QUANTPIPE_RUNNER_PID")
    if os.getppid() == 1 or (runner and runner.isdigit() and os.getppid() != int(runner)):
        os._exit(143)


def resource_error(e: BaseException, out: Path) -> str | None:
    """A sentence for a stage that ran out of disk or memory (anywhere in the exception's chain), else None."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = str(e)
        code = getattr(e, "errno", None)
        if code in (errno.ENOSPC, errno.EDQUOT) or "No space left on device" in text or "StorageFull" in text:
            where = getattr(e, "filename", None) or out
            try:
                free = f"{shutil.disk_usage(out if out.exists() else out.parent).free / 2**20:.1f} MiB free there now"
            except OSError:
                free = "free space unknown"
            return (
                f"no space left on the device while writing {where} ({free}); free some space, or set cache_dir "
                "(or $QUANTPIPE_CACHE) to a larger disk, and run again"
            )
        if (
            isinstance(e, MemoryError)
            or code == errno.ENOMEM
            or "can't allocate memory" in text
            or "Cannot allocate memory" in text
        ):
            return (
                f"out of memory ({type(e).__name__}: {text[:200] or 'no message'}; peak RSS {peak_rss_gib()} GiB); "
                "give the stage more memory, or reduce what it holds (fewer calibration samples, shorter sequences)"
            )
        e = e.__cause__ or e.__context__
    return None


def peak_rss_gib() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return round(max(me, kids) / 2**20, 3)


def main(spec_path: str) -> int:
    _die_with_parent()
    _bootstrap()
    spec = json.loads(Path(spec_path).read_text())
    joint = spec.get("evaluate")
    if joint is None:
        return run_stage(spec)
    # A joint job: the artifact's evaluation through the benchmark's server, once it is healthy and before the sweep.
    # Each stage writes its own metrics (or failed.json); the exit code is the benchmark's.
    evaluated = []

    def on_ready(server) -> None:
        evaluated.append(run_stage(joint, server=server))

    rc = run_stage(spec, on_ready=on_ready)
    if (
        not evaluated and rc == 0
    ):  # not servable here, decided before a server started: the evaluation says why it cannot
        run_stage(joint)
    elif not evaluated:  # the server failed: the evaluation fails with its cause, rather than start a server the
        # scheduler did not size beside the others on the GPU
        try:
            why = json.loads(Path(spec["metrics"]).with_name("failed.json").read_text())
        except (OSError, ValueError):
            why = {"rc": rc, "error": f"it exited with code {rc}"}
        error = f"the server it shares with {spec['stage']} failed: {why['error']}"
        Path(joint["metrics"]).with_name("failed.json").write_text(
            json.dumps({"rc": why["rc"], "error": error, "fault": why.get("fault", False)})
        )
    return rc


def run_stage(spec: dict, **shared) -> int:
    """Run the stage `spec` names; metrics go to spec["metrics"], a failure's exit code and message to failed.json beside it."""
    from quantpipe.envs import STAGES
    from quantpipe.stages import StageError
    from quantpipe.stages.contract import INPUTS, Upstream

    mod_name, fn_name = STAGES[spec["kind"]][0].split(":")
    fn = getattr(importlib.import_module(mod_name), fn_name)
    inp = INPUTS[spec["kind"]].model_validate(spec["input"])
    upstream = {role: Upstream.from_json(u) for role, u in spec.get("upstream", {}).items()}
    src = Path(spec["src"]).absolute()
    failed = Path(spec["metrics"]).with_name("failed.json")
    t0 = time.perf_counter()
    cwd = os.getcwd()
    os.chdir(
        Path(spec["out"]).parent
    )  # files a library drops in its working directory (GPTQModel's logs) stay in the stage's folder
    try:
        metrics = fn(inp, src, Path(spec["out"]), upstream, **shared) or {}
    except StageError as e:
        print(f"quantpipe: {spec['stage']}: {e}", file=sys.stderr)
        print(f"STAGE_ERROR: {e}", file=sys.stderr)
        failed.write_text(json.dumps({"rc": 2, "error": str(e), "fault": getattr(e, "fault", False)}))
        return 2
    except Exception as e:
        traceback.print_exc()
        why = resource_error(e, Path(spec["out"]))
        if why:
            print(f"STAGE_ERROR: {why}", file=sys.stderr)
        failed.write_text(json.dumps({"rc": 1, "error": why or f"{type(e).__name__}: {e}"}))
        return 1
    finally:
        os.chdir(
            cwd
        )  # a joint job's evaluation ends inside its benchmark: the benchmark's files stay out of its folder
    metrics = {**metrics, "wall_s": round(time.perf_counter() - t0, 3), "peak_rss_gib": peak_rss_gib()}
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.max_memory_allocated() > 0:
            metrics["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    except Exception:
        pass
    tmp = Path(spec["metrics"]).with_suffix(".tmp")
    tmp.write_text(json.dumps(metrics, indent=2, default=str))
    os.replace(
        tmp, spec["metrics"]
    )  # whole or absent: in a joint job the runner commits the evaluation as soon as it appears
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
