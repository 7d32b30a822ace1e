"""Measuring one server: warm-up, a `vllm bench serve` run per workload x concurrency, and the engine's own stats. The
prefix cache is reset before each run, so runs do not feed each other's caches; around each run the server's Prometheus
/metrics give prefix-cache hits and preemptions, and its log's stats lines (every STATS_INTERVAL_S) KV-cache usage and
running/waiting requests. A run's arguments and result row are bench_serve.py's, the readings of the server's figures
server_metrics.py's.

    rows, totals = measure(srv, inp.benchmark, "default", workloads, data, tokenizer, out)
"""

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path

from ...common.measure_gate import measuring
from ...common.vllm_support import LINEAR_KERNEL, engine_flags
from ...recipe import Benchmark, Workload
from ...server import Server, ServerDied
from ...server_output import fault_cause
from .. import HostFault
from .bench_serve import bench_serve_args, require_completed, row_from_vllm, slo_goodput_args, slo_met, vllm_bench_serve
from .client import BenchClient
from .server_metrics import counters, engine_stats, kv_gib, kv_tokens, loaded_weights_gib, weights_gib
from .startup import startup_phases
from .stats import prompts_for, widest_half_width

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 1.0  # VLLM_LOG_STATS_INTERVAL for the servers quantpipe starts
# The warm-up's first request (a workload-length prompt, 4 output tokens) must finish within this: a server that slow
# (an emulated kernel, such as FP8 through torch._scaled_mm on a CPU without FP8 hardware) would take hours to sweep.
FIRST_REQUEST_S = 120.0


def reset_prefix_cache(srv: Server) -> bool:
    import urllib.error
    import urllib.request

    try:
        req = urllib.request.Request(f"{srv.url}/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def warm_up(
    srv: Server, w: Workload, vocab: int, models: list[str], seed: int, max_len: int | None = None, batch: int = 1
) -> None:
    """A few requests (token-id prompts unlike any workload's) so the runs measure a warm server; for LoRA, one per adapter
    so that loading it is not timed, then `batch` at once: on an H200 the first batched LoRA run after single-request
    warm-up took 2.7 s to first token (kernels compiled for the batch), 40x the merged model's."""
    rng = random.Random(seed + 7919)
    n_in = max(8, min(w.input_len + (w.prefix_len if w.kind == "shared_prefix" else 0), 512, (max_len or 520) - 8))
    try:  # the first request has a deadline: a server too slow to measure is said to be so in minutes, not hours
        srv.completion(
            [rng.randrange(100, max(101, vocab - 1)) for _ in range(n_in)],
            max_tokens=4,
            model=models[0],
            timeout_s=FIRST_REQUEST_S,
        )
    except ServerDied as e:
        if "timed out" not in e.reason:
            raise
        kernels = sorted({f"{k} ({what})" for k, what in LINEAR_KERNEL.findall(srv.log_text())})
        raise ServerDied(
            f"a first request of {n_in} prompt tokens and 4 output tokens took over {FIRST_REQUEST_S:g} s, too slow "
            "to measure"
            + (f" (vLLM serves its layers with {', '.join(kernels)})" if kernels else "")
            + "; measure it on hardware with native kernels for its scheme",
            e.log_tail,
            verdict=True,
        ) from None
    for model in models:  # one prompt of the workload's length, one short: first-use costs of both shapes are paid here
        for n in (n_in, 16):
            srv.completion([rng.randrange(100, max(101, vocab - 1)) for _ in range(n)], max_tokens=4, model=model)
    if batch > 1:
        from concurrent.futures import ThreadPoolExecutor

        prompts = [
            ([rng.randrange(100, max(101, vocab - 1)) for _ in range(16)], models[i % len(models)])
            for i in range(batch)
        ]
        with ThreadPoolExecutor(batch) as pool:
            list(pool.map(lambda pm: srv.completion(pm[0], max_tokens=4, model=pm[1]), prompts))
    srv.check_alive()


# --- measuring one server ---------------------------------------------------------------------


def measure(
    srv: Server,
    bench: Benchmark,
    variant: str,
    workloads: list[Workload],
    data: dict,
    tokenizer: str,
    out: Path,
    lora_names: list[str] | None = None,
    client: BenchClient | None = None,
) -> tuple[list[dict], dict]:
    """Every workload x concurrency against a running server; returns (rows, totals over the runs). `client` runs the
    `vllm bench serve` runs (one of its own for this call when None)."""
    if client is None:
        with BenchClient(out / "logs" / f"bench-client-{variant}.log") as own:
            return measure(srv, bench, variant, workloads, data, tokenizer, out, lora_names, own)
    goodput = slo_goodput_args(bench.slo)
    rows = []
    first = srv.metrics()
    peak_usage = None
    can_reset = True
    for wi, w in enumerate(workloads):
        for ci, c in enumerate(bench.concurrency):
            can_reset = reset_prefix_cache(srv) and can_reset
            # Without a cache reset, a different seed keeps runs from reusing each other's prompts.
            seed = bench.seed if can_reset else bench.seed + 1000 * wi + ci
            row = _run_point(srv, bench, variant, w, c, seed, data, tokenizer, out, goodput, lora_names, client)
            n = (
                prompts_for(bench.precision, w.num_prompts, row["half_width"], bench.max_prompts)
                if bench.precision
                else w.num_prompts
            )
            if (
                n > w.num_prompts
            ):  # the first run was a pilot: run the point again with as many requests as its spread asks
                log.info(
                    "benchmark %s: workload %s, concurrency %d: ±%.1f%% from %d requests, %d for ±%.1f%%",
                    variant,
                    w.name,
                    c,
                    100 * row["half_width"],
                    w.num_prompts,
                    n,
                    100 * bench.precision,
                )
                pilot = {
                    "num_prompts": w.num_prompts,
                    "half_width": row["half_width"],
                    "raw": _set_aside(out, row["raw"]),
                }
                can_reset = reset_prefix_cache(srv) and can_reset
                row = _run_point(
                    srv,
                    bench,
                    variant,
                    w.model_copy(update={"num_prompts": n}),
                    c,
                    seed,
                    data,
                    tokenizer,
                    out,
                    goodput,
                    lora_names,
                    client,
                ) | {"pilot": pilot}
            rows.append(row)
            if row["kv_cache_usage_peak"] is not None:
                peak_usage = max(peak_usage or 0.0, row["kv_cache_usage_peak"])
    last = srv.metrics()
    t0, t1 = counters(first), counters(last)
    dq = t1["queries"] - t0["queries"]
    totals = {
        "prefix_cache_hit_rate": round((t1["hits"] - t0["hits"]) / dq, 4) if dq > 0 else None,
        "preemptions": int(t1["preemptions"] - t0["preemptions"]),
        "kv_cache_usage_peak": peak_usage,
        "kv_cache_tokens": kv_tokens(last, srv.log_text()),
        "kv_cache_gib": kv_gib(last),
        "prefix_cache_reset": can_reset,
    }
    return rows, totals


def _run_point(
    srv: Server,
    bench: Benchmark,
    variant: str,
    w: Workload,
    c: int,
    seed: int,
    data: dict,
    tokenizer: str,
    out: Path,
    goodput: list[str],
    lora_names: list[str] | None,
    client: BenchClient,
) -> dict:
    """One `vllm bench serve` run of workload `w` at concurrency `c`: its result row, with the engine's stats around it."""
    raw_dir = out / "raw" / variant
    fname = f"{w.name}-c{c}.json"
    args = bench_serve_args(srv, w, data.get(w.name), c, tokenizer, seed, raw_dir, fname, goodput, lora_names)
    before = counters(srv.metrics())
    log_at = len(srv.log_text())
    log.info("benchmark %s: workload %s, concurrency %d, %d requests", variant, w.name, c, w.num_prompts)
    bench_log = out / "logs" / f"bench-{variant}-{w.name}-c{c}.log"
    vllm_bench_serve(client, args, bench_log)
    time.sleep(STATS_INTERVAL_S * 1.2)  # let the engine log the stats of the run's last interval
    srv.check_alive()
    stats = engine_stats(srv.log_text()[log_at:])
    after = counters(srv.metrics())
    raw = json.loads((raw_dir / fname).read_text())
    require_completed(raw, f"workload {w.name!r} at concurrency {c} (variant {variant!r})", bench_log)
    row = {
        "variant": variant,
        "workload": w.name,
        "kind": w.kind,
        "concurrency": c,
        "num_prompts": w.num_prompts,
        **row_from_vllm(raw, bench.slo if goodput else None),
    }
    row["goodput"] = raw.get("request_goodput") if goodput else None
    row["slo_met"] = slo_met(row, bench.slo)
    row["half_width"] = widest_half_width(row)
    dq = after["queries"] - before["queries"]
    row["prefix_cache_hit_rate"] = round((after["hits"] - before["hits"]) / dq, 4) if dq > 0 else None
    row["preemptions"] = int(after["preemptions"] - before["preemptions"])
    row |= stats
    row["raw"] = str((raw_dir / fname).relative_to(out))
    return row


def search_goodput(
    srv: Server, bench: Benchmark, rows: list[dict], data: dict, tokenizer: str, out: Path, client: BenchClient
) -> dict:
    """`benchmark.goodput_search`: the highest concurrency up to its bound at which the SLO holds on the first workload,
    bisecting from the sweep's points; each probe is a run like a sweep point's, its row under `rows` (raw in raw/search/)."""
    from .choose import highest_within_slo

    w = bench.workloads[0]
    known = {r["concurrency"]: bool(r["slo_met"]) for r in rows if r["workload"] == w.name and r["slo_met"] is not None}
    probes: dict[int, dict] = {}

    def probe(c: int) -> bool:
        reset_prefix_cache(srv)
        row = _run_point(
            srv, bench, "search", w, c, bench.seed, data, tokenizer, out, slo_goodput_args(bench.slo), None, client
        )
        probes[c] = row
        return bool(row["slo_met"])

    found, probed = highest_within_slo(probe, known, bench.goodput_search)
    at = probes.get(found) or next((r for r in rows if r["workload"] == w.name and r["concurrency"] == found), None)
    return {
        "workload": w.name,
        "bound": bench.goodput_search,
        "concurrency": found,
        "goodput": (at or {}).get("goodput") if found else 0.0,
        "goodput_ci95": ((at or {}).get("ci95") or {}).get("goodput"),
        "from_sweep": sorted(known),
        "probed": probed,
        "rows": [probes[c] for c in probed],
    }


def _set_aside(out: Path, raw: str) -> str:
    """Keep a pilot run's result and log beside the final run's (`*-pilot.json`, `*-pilot.log`); the pilot's result path."""
    res = out / raw
    log_path = out / "logs" / f"bench-{res.parent.name}-{res.stem}.log"
    if log_path.exists():
        log_path.rename(log_path.with_name(log_path.stem + "-pilot.log"))
    res.rename(res.with_name(res.stem + "-pilot.json"))
    return str(res.with_name(res.stem + "-pilot.json").relative_to(out))


def serve_variant(
    name: str,
    model: Path,
    engine: dict,
    bench: Benchmark,
    served_model_name: str,
    plat: dict,
    workloads,
    data,
    tokenizer: str,
    out: Path,
    vocab: int,
    extra_args: list[str] = (),
    lora_names: list[str] | None = None,
    *,
    client: BenchClient,
    on_ready=None,
) -> dict:
    """Start a server with `engine`, warm it up and measure it (runs from `client`); never leaves it running.
    `on_ready(server)` (a joint job's evaluation) runs once it is healthy, before the warm-up and a prefix-cache reset."""
    info: dict = {"engine": engine, "servable": True, "reason": None, "log": f"logs/server-{name}.log"}
    srv = Server(
        model,
        [*engine_flags(engine), *extra_args],
        log_path=out / info["log"],
        served_model_name=served_model_name,
        env={"VLLM_SERVER_DEV_MODE": "1", "VLLM_LOG_STATS_INTERVAL": str(STATS_INTERVAL_S)},
        gpu=plat.get("platform") == "cuda",
    )
    try:
        with srv:
            info["server_start_s"], info["port"] = srv.start_s, srv.port
            info["startup"] = startup_phases(srv.log_text(), srv.start_s)
            log.info("server %s healthy after %.1f s on port %d", name, srv.start_s, srv.port)
            if on_ready is not None:
                t0 = time.perf_counter()
                on_ready(srv)
                info["shared_s"] = round(time.perf_counter() - t0, 2)
                reset_prefix_cache(srv)
            with measuring() as info["gate"]:  # a shared GPU: the warm-up and the runs have it to themselves
                warm_up(
                    srv,
                    workloads[0],
                    vocab,
                    [srv.served_model_name] if not lora_names else lora_names,
                    bench.seed,
                    engine.get("max_model_len"),
                    batch=max(bench.concurrency) if lora_names else 1,
                )
                rows, totals = measure(srv, bench, name, workloads, data, tokenizer, out, lora_names, client)
                info["rows"] = rows
                if bench.goodput_search and name == "default":
                    info["goodput_search"] = search_goodput(srv, bench, rows, data, tokenizer, out, client)
            info["memory"] = {
                **totals,
                "weights_gib": weights_gib(model),
                "weights_loaded_gib": loaded_weights_gib(srv.log_text()),
            }
        info["memory"]["peak_rss_gib"] = round(srv.peak_rss_bytes / 2**30, 3)
        if plat.get("platform") == "cuda":
            mem = info["memory"]
            mem["peak_gpu_gib"] = round(srv.peak_gpu_bytes / 2**30, 3)
            if mem["peak_gpu_gib"] and mem.get("kv_cache_gib"):  # what the runner learns for sizing the next servers
                weights = mem.get("weights_loaded_gib") or mem["weights_gib"]
                mem["overhead_gib"] = round(mem["peak_gpu_gib"] - weights - mem["kv_cache_gib"], 3)
    except ServerDied as e:
        fault = None if e.verdict else fault_cause(e.reason, e.log_tail, started=srv.start_s is not None)
        if fault:
            raise HostFault(
                f"the {name!r} server of {served_model_name} failed: {fault} ({e.reason}). A fault of this host, not a "
                f"verdict on the model: nothing of this benchmark is kept, and the next run measures it again "
                f"(its log: {out / info['log']})"
            ) from None
        info.update(servable=False, reason=f"not servable here: {e.reason}", log_tail=e.log_tail, rows=[])
        info.setdefault("server_start_s", srv.start_s)
        info.setdefault("port", srv.port)
        log.warning("variant %s: %s", name, info["reason"])
    return info
