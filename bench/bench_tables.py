#!/usr/bin/env python
"""Print the Markdown tables of docs/BENCHMARKS.md from one run's run.json (nothing else is read).

    python bench/bench_tables.py docs/records/2026-11-30-llama3-8b-recipe-2xh200/runs/h200-llama3-8b-full-20261130-190111-12681.json

Per stage: the runner's wall time of the stage when it was built (`stage_wall_s`, a cache hit keeps the
figure of its build), the stage function's own time and its split, peak RSS and peak GPU memory.
Per artifact: every concurrency of the recipe's first workload, with the ratios against the baseline
(BF16) measured by the same recipe. Then the sum of the stage times (GPU-minutes when one GPU runs them
one after another).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _f(v, fmt="{:.1f}", unit=""):
    return "" if v is None else fmt.format(v) + unit


def _split(kind: str, m: dict) -> str:
    if kind == "quantize":
        return f"oneshot {_f(m.get('oneshot_s'))} s, save {_f(m.get('save_s'))} s"
    if kind == "benchmark":
        return f"server start {_f(m.get('server_start_s'))} s"
    if kind == "evaluate":
        t = m.get("timings") or {}
        return ", ".join(f"{k.removesuffix('_s')} {v:.1f} s" for k, v in t.items() if isinstance(v, (int, float)))
    if kind == "package":
        return f"{m.get('shards')} shards, {m.get('hardlinked_shards')} hard-linked" + (
            ", re-sharded" if m.get("resharded") else ""
        )
    if kind == "merge":
        return f"max |Δlogit| {m.get('merge_max_abs_diff', 0):.1e} (tolerance {m.get('merge_tolerance', 0):.1e})"
    return ""


def stage_table(rec: dict) -> tuple[list[str], float]:
    rows = [
        "| stage | wall (runner) | inside the stage | split | peak RSS | peak GPU |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    total = 0.0
    for sid, s in rec["stages"].items():
        m = s.get("metrics") or {}
        wall = s.get("stage_wall_s") or s.get("wall_s")
        total += wall or 0
        gpu = (
            m.get("peak_gpu_gib") if m.get("peak_gpu_gib") is not None else (m.get("memory") or {}).get("peak_gpu_gib")
        )
        rows.append(
            f"| {sid} | {_f(wall, unit=' s')} | {_f(m.get('wall_s'), unit=' s')} | {_split(s['kind'], m)} | "
            f"{_f(m.get('peak_rss_gib'), '{:.1f}', ' GiB')} | {_f(gpu, '{:.2f}', ' GiB')} |"
        )
    return rows, total


def artifact_table(rec: dict) -> list[str]:
    benches = {
        sid.split(":", 1)[1]: s.get("metrics") or {} for sid, s in rec["stages"].items() if sid.startswith("benchmark:")
    }
    base = {
        r["concurrency"]: r for r in benches.get("baseline", {}).get("results", []) if r.get("variant") == "default"
    }
    rows = [
        "| artifact | weights | KV cache | concurrency | req/s | output tok/s | TTFT p50 / p99 | TPOT p50 / p99 | e2e p50 | goodput | vs BF16: e2e p50, tok/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, b in benches.items():
        results = [r for r in b.get("results", []) if r.get("variant") == "default"]
        if not results:
            continue
        first = results[0]["workload"]
        mem = b.get("memory") or {}
        for i, r in enumerate(r for r in results if r["workload"] == first):
            br = base.get(r["concurrency"])
            ratio = (
                f"{r['e2el_ms']['p50'] / br['e2el_ms']['p50']:.2f}×, {r['output_throughput'] / br['output_throughput']:.2f}×"
                if br and name != "baseline"
                else ""
            )
            head = (
                f"| {name} | {_f(mem.get('weights_gib'), '{:.2f}', ' GiB')} | {mem.get('kv_cache_tokens'):,} tokens"
                if i == 0
                else "| | |"
            )
            rows.append(
                f"{head} | {r['concurrency']} | {r['request_throughput']:.2f} | {r['output_throughput']:,.0f} | "
                f"{r['ttft_ms']['p50']:.1f} / {r['ttft_ms']['p99']:.1f} ms | {r['tpot_ms']['p50']:.2f} / {r['tpot_ms']['p99']:.2f} ms | "
                f"{r['e2el_ms']['p50']:,.0f} ms | {_f(r.get('goodput'), '{:.2f}')} | {ratio} |"
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_json", type=Path)
    rec = json.loads(ap.parse_args().run_json.read_text())
    rows, total = stage_table(rec)
    print("\n".join(rows))
    print(f"\nsum of the stage times: {total:.0f} s = {total / 60:.1f} minutes ({len(rec['stages'])} stages)\n")
    print("\n".join(artifact_table(rec)))


if __name__ == "__main__":
    main()
