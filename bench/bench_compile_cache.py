#!/usr/bin/env python
"""vLLM's compile cache across rebuilds: what the benchmark stage's stable serving links save.

vLLM keys its torch.compile cache on the served model's path, among other factors, and a nightly build of
a new fine-tune puts every artifact at a new path (a new merge, new stage-cache directories), so each of
its servers would compile again. The benchmark stage serves through a link named by the artifact's
config.json instead (`quantpipe.serving_links.stable_path`). This runs a recipe's benchmark stages (baseline and
the artifacts given, with what they need) night after night, each night from a new directory of the base
model (hard links: to vLLM as new as a new merge) into a new stage cache, alternately with the links of
night 1 ("links") and with a links directory of its own ("control": what every night costs without them). It
prints each server's start time and what its log says of torch.compile, and writes the table as JSON.

Run it in the quantize environment (the `quantpipe` CLI) with the same engine settings a real night has;
vLLM's compile cache ($VLLM_CACHE_ROOT, default ~/.cache/vllm) is shared by every night, as on a build host:

    .venv/quantize/bin/python bench/bench_compile_cache.py recipes/demo.yaml --artifacts int8 --compile
    python3 bench/bench_compile_cache.py bench/recipes/h200-llama3-8b-nightly.yaml --nights 3 --workdir /tmp/qp/nightly
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from quantpipe.recipe import RecipeError, load

# What a vLLM server log says of torch.compile and of the engine's start (0.26 on CUDA, 0.32 on the CPU):
# "Directly load ..." is a compile-cache hit (the AOT-compiled function or the compiled graphs).
COMPILE_LINES = re.compile(
    r"torch\.compile take|Compiling a graph|Directly load|Dynamo bytecode transform|AOT compiled|init engine"
)


def night_recipe(recipe_path: Path, n: int, work: Path, compile_: bool) -> Path:
    """The recipe of night n: the base model from a new directory of hard links, its own output directory."""
    r = load(recipe_path).model_dump(mode="json", exclude_none=True)
    base = work / f"night{n}" / "base"
    if not base.exists():
        shutil.copytree(r["base"]["model"], base, copy_function=os.link)
    r["base"]["model"] = str(base)
    r["output_dir"] = str(work / f"night{n}" / "out")
    r.pop("cache_dir", None)
    if compile_:
        r["benchmark"]["engine"]["enforce_eager"] = False
    path = work / f"night{n}" / "recipe.yaml"
    path.write_text(yaml.safe_dump(r, sort_keys=False))
    return path


def servers(cache: Path) -> list[dict]:
    """Every server the night's benchmark stages started: its artifact, start time, path and compile lines."""
    rows = []
    for res in sorted(cache.glob("stages/benchmark/*/*/out/results.json")):
        m = json.loads(res.read_text())
        for vname, v in m.get("variants", {}).items():
            log = (res.parent / v["log"]).read_text(errors="replace")
            lines = [ln.split("] ", 1)[-1][:160] for ln in log.splitlines() if COMPILE_LINES.search(ln)]
            rows.append(
                {
                    "artifact": m["artifact"],
                    "variant": vname,
                    "server_start_s": v.get("server_start_s"),
                    "served_path": m.get("served_path"),
                    "compile_log": lines,
                    "loaded_from_cache": any("Directly load" in ln for ln in lines),
                }
            )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe", type=Path)
    ap.add_argument(
        "--artifacts", default=None, help="artifacts to build and benchmark besides the baseline (default: all)"
    )
    ap.add_argument("--nights", type=int, default=3, help="nights: 1 warms the cache, then control and links alternate")
    ap.add_argument("--workdir", type=Path, default=None, help="where the nights go (default: a new temporary folder)")
    ap.add_argument(
        "--compile",
        action="store_true",
        help="serve with torch.compile (enforce_eager: false) whatever the recipe says",
    )
    ap.add_argument("--json", type=Path, default=None, help="write the table here too")
    ap.add_argument(
        "--report-only", action="store_true", help="run nothing: print the table of the nights in --workdir"
    )
    a = ap.parse_args()
    if a.report_only and not a.workdir:
        ap.error("--report-only needs --workdir")
    try:
        load(a.recipe)
    except RecipeError as e:
        ap.error(str(e))
    work = (a.workdir or Path(tempfile.mkdtemp(prefix="qp-nightly-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    qp = [
        sys.executable,
        "-m",
        "quantpipe",
        "run",
        "--stages",
        "benchmark",
        *(["--artifacts", a.artifacts] if a.artifacts else []),
    ]
    for n in [] if a.report_only else range(1, a.nights + 1):
        mode = "links" if n % 2 else "control"
        links = work / ("links" if mode == "links" else f"links-night{n}")
        env = {
            **os.environ,
            "QUANTPIPE_CACHE": str(work / f"night{n}" / "cache"),
            "QUANTPIPE_SERVING_LINKS": str(links),
        }
        t0 = time.perf_counter()
        p = subprocess.run([*qp, str(night_recipe(a.recipe, n, work, a.compile))], env=env)
        (work / f"night{n}" / "night.json").write_text(
            json.dumps({"mode": mode, "wall_s": round(time.perf_counter() - t0, 1)})
        )
        if p.returncode != 0:
            print(f"night {n}: quantpipe run exited {p.returncode}", file=sys.stderr)
            return 1
    table = []
    for night in sorted(work.glob("night*/night.json"), key=lambda q: int(q.parent.name[5:])):
        n, info = int(night.parent.name[5:]), json.loads(night.read_text())
        for s in servers(night.parent / "cache"):
            table.append({"night": n, "mode": info["mode"], "night_wall_s": info["wall_s"], **s})
    print(f"\n{'night':>5} {'mode':8} {'artifact':12} {'variant':10} {'start s':>8}  compiled graphs")
    for t in table:
        print(
            f"{t['night']:>5} {t['mode']:8} {t['artifact']:12} {t['variant']:10} {t['server_start_s']:>8}  "
            f"{'loaded from the cache' if t['loaded_from_cache'] else 'compiled'}"
        )
    for t in table:
        print(f"\nnight {t['night']} ({t['mode']}) {t['artifact']}/{t['variant']} via {t['served_path']}:")
        print("\n".join(f"  {ln}" for ln in t["compile_log"]) or "  (no torch.compile lines: eager?)")
    if a.json:
        a.json.write_text(json.dumps({"recipe": str(a.recipe), "workdir": str(work), "servers": table}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
