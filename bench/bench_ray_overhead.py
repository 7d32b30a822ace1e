#!/usr/bin/env python
"""What `--executor ray` costs against the local executor: one recipe, each executor from an empty stage cache.

A Ray cluster of one node is started on this host (every stage asks for all of its cores, as the local
executor runs one CPU stage at a time), the recipe runs through it, then through the local executor; each
run gets its own empty cache and output directory. Both run at the same CPU priority (Ray would run its
tasks at nice 15, and other work on a shared host would then slow the Ray run alone). It prints, side by
side, each run's wall time, the stages' own time (the sum of their wall times: they run one after another
in both) and the rest (planning, the cluster probe, submission, records), and writes them as JSON.

On a shared host the stages' own speed varies between two runs by more than the executor costs; the rest
is what the executor adds. Run it in the quantize environment (the `quantpipe` CLI, with Ray):

    .venv/quantize/bin/python bench/bench_ray_overhead.py recipes/demo-tiny.yaml
    .venv/quantize/bin/python bench/bench_ray_overhead.py recipes/demo-tiny.yaml --artifacts int8 --stages quantize
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from helpers.ray_cluster import MARK, ray_cluster  # noqa: E402

from quantpipe.recipe import RecipeError, load  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe", type=Path)
    ap.add_argument(
        "--workdir", type=Path, default=None, help="where the caches and outputs go (default: a new temporary folder)"
    )
    ap.add_argument("--json", type=Path, default=None, help="write the figures here too")
    args, run_args = ap.parse_known_args()
    try:
        recipe = load(args.recipe).model_dump(mode="json", exclude_none=True)
    except RecipeError as e:
        print(f"{args.recipe}: {e}", file=sys.stderr)
        return 2
    work = args.workdir or Path(tempfile.mkdtemp(prefix="qp-ray-overhead-"))
    walls, stages = {}, {}
    with ray_cluster(1, system={"worker_niceness": 0}, num_cpus=os.cpu_count() or 2) as c:
        for executor in ("ray", "local"):
            run_dir = work / executor
            run_dir.mkdir(parents=True, exist_ok=True)
            r = {**recipe, "output_dir": str(run_dir / "out")}
            r.pop("cache_dir", None)
            path = run_dir / "recipe.yaml"
            path.write_text(yaml.safe_dump(r, sort_keys=False))
            extra = ["--executor", "ray", "--address", c.address] if executor == "ray" else []
            env = {**os.environ, MARK: c.mark, "TMPDIR": str(run_dir)}
            t0 = time.monotonic()
            with open(run_dir / "console.log", "w") as log:
                rc = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "quantpipe",
                        "run",
                        str(path),
                        "--cache",
                        str(run_dir / "cache"),
                        *run_args,
                        *extra,
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                ).returncode
            walls[executor] = round(time.monotonic() - t0, 1)
            if rc != 0:
                print(f"the {executor} run failed (exit {rc}): see {run_dir / 'console.log'}", file=sys.stderr)
                return 1
            rec = json.loads(sorted((run_dir / "out" / "runs").glob("*/run.json"))[-1].read_text())
            stages[executor] = round(sum(st.get("stage_wall_s") or 0 for st in rec["stages"].values()), 1)
    rest = {e: round(walls[e] - stages[e], 1) for e in walls}
    result = {
        "recipe": str(args.recipe),
        "args": run_args,
        "wall_s": walls,
        "stages_s": stages,
        "rest_s": rest,
        "wall_ratio": round(walls["ray"] / walls["local"], 3),
        "ray_adds_of_local_wall": round((rest["ray"] - rest["local"]) / walls["local"], 3),
    }
    print(f"{'executor':<10}{'wall':>10}{'stages':>10}{'rest':>10}")
    for e in ("local", "ray"):
        print(f"{e:<10}{walls[e]:>9.1f}s{stages[e]:>9.1f}s{rest[e]:>9.1f}s")
    print(
        f"ray/local wall {result['wall_ratio']:.3f}; what Ray adds around the stages: {100 * result['ray_adds_of_local_wall']:.1f} % of the local wall time"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
