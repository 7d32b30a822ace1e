"""Benchmark stage: serve an artifact (or the baseline) with vLLM and measure it the way vLLM does.

Per engine variant it starts `vllm serve` (quantpipe.server), warms it up and runs `vllm bench serve` for
every workload x concurrency (measure.py, workloads.py), optionally vLLM's offline benchmarks (offline.py)
and, for a baseline with adapters, the unmerged base with LoRA attached (engine.py, choose.py). An artifact
this platform cannot serve is reported (`servable: false` and why), not crashed on. The fields of
out/results.json (the returned metrics) are listed in docs/outputs.md.

    quantpipe run recipes/demo.yaml --stages benchmark
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from ...common.measure_gate import ENV as GATE_ENV
from ...common.measure_gate import measuring
from ...common.vllm_support import probe_platform, quant_scheme, unservable_reason, variant_engines
from ...serving_links import stable_path
from .. import StageError
from ..contract import BenchmarkInput, Upstream
from .choose import compare_lora, pick_best
from .client import BenchClient
from .engine import effective_engine, lora_setup
from .measure import serve_variant
from .offline import offline
from .starts import pool_search, pool_starts
from .workloads import validation_rows, workload_data

log = logging.getLogger(__name__)
SHARED_NOTE = (
    "the server started beside other work on its GPU (or CPU host; the engine sets kv_cache_memory_bytes, so the "
    "scheduler shares the device outside measured runs): its start-up phases include that contention; its warm-up "
    "and every measured run had the device to itself (`gate` in each variant: how long it waited for it)"
)


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("vllm", "torch", "transformers", "compressed-tensors"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def _further_starts(bench, first: dict, serve) -> list[tuple[int, dict]]:
    """`benchmark.server_starts`: serve the default engine again from fresh servers (`serve(name, bench)`), each
    measuring the sweep and, after a goodput search, the search's concurrency too; [(start, info)] from start 2."""
    found = (first.get("goodput_search") or {}).get("concurrency")
    if found and found not in bench.concurrency:
        bench = bench.model_copy(update={"concurrency": sorted({*bench.concurrency, found})})
    return [(k, serve(name, bench)) for k, name in enumerate(bench.start_names(), start=2)]


def _start_info(k: int, info: dict) -> dict:
    """One server start of `engine` (`benchmark.server_starts`): how it went, without its rows."""
    keep = ("servable", "reason", "server_start_s", "port", "log", "memory", "gate")
    return {"start": k, **{f: info.get(f) for f in keep}}


def run(inp: BenchmarkInput, src: Path, out: Path, upstream: dict[str, Upstream], on_ready=None) -> dict:
    """Serve `src` with vLLM and measure it (see the module docstring); writes out/results.json. Reads no upstream.
    `on_ready(server)`: called once the default variant's server is healthy, before its warm-up and sweep (the
    artifact's evaluation in a joint job, quantpipe.worker); `shared_s` records how long it held the server."""
    t_stage = time.perf_counter()
    src, out = Path(src), Path(out)
    bench = inp.benchmark
    (out / "logs").mkdir(parents=True, exist_ok=True)
    from ...envs import hardware

    plat = probe_platform()
    result: dict = {
        "artifact": inp.artifact,
        "method": inp.method,
        "servable": True,
        "reason": None,
        "status_note": None,
        "platform": plat["platform"],
        "platform_info": plat,
        "engine": None,
        "engine_notes": [],
        "server_start_s": None,
        "startup": None,
        "shared_s": None,
        "results": [],
        "variants": {},
        "memory": None,
        "offline": None,
        "best": None,
        "goodput_search": None,
        "lora": None,
        "server_starts": None,
        "workloads": [],
        "versions": _versions(),
        "hardware": hardware(),
    }

    def finish() -> dict:
        result["wall_s"] = round(time.perf_counter() - t_stage, 2)
        (out / "results.json").write_text(json.dumps(result, indent=2, default=str))
        return result

    reason = unservable_reason(quant_scheme(src), inp.method, plat)
    if reason:
        result.update(servable=False, reason=f"not servable here: {reason}", status_note=f"not servable here: {reason}")
        log.warning("%s: %s", inp.artifact, result["reason"])
        return finish()

    # Workloads: validate and build their data before any server starts.
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(src))
    except (OSError, ValueError) as e:
        raise StageError(f"{src}: no usable tokenizer ({str(e)[:200]}); save the tokenizer next to the model") from None
    vocab = len(tok)
    workloads = list(bench.workloads)
    val_rows = validation_rows(workloads, inp.validation)
    variants = variant_engines(inp)
    data, need, result["workloads"] = workload_data(workloads, val_rows, variants, tok, out)

    # The baseline's LoRA comparison: the input carries adapters only then (base.model is the unmerged base).
    lora_flags = lora_names = lora_notes = None
    if inp.adapters:
        lora_flags, lora_names, lora_notes = lora_setup(inp.adapters)

    failed_variants = []
    client = BenchClient(out / "logs" / "bench-client.log")  # its `vllm bench serve` runs (client.py: forked on CUDA)

    def serve(name: str, model: Path, engine: dict, b=bench, **kw) -> dict:
        return serve_variant(
            name,
            model,
            engine,
            b,
            inp.served_model_name,
            plat,
            workloads,
            data,
            str(src),
            out,
            vocab,
            client=client,
            **kw,
        )

    # Served by a stable link, so a rebuild of the same shape and scheme finds vLLM's compile cache (see stable_path).
    try:
        client.start()  # on a CUDA host its imports overlap the server's start
        with stable_path(src) as served:
            result["served_path"] = str(served)
            for vname, e in variants:
                engine, notes = effective_engine(e, inp, src, plat, need)
                if os.environ.get(GATE_ENV):
                    notes = [*notes, SHARED_NOTE]
                info = serve(vname, served, engine, on_ready=on_ready if vname == "default" else None)
                info["engine_notes"] = notes
                result["variants"][vname] = {k: v for k, v in info.items() if k not in ("rows", "goodput_search")}
                result["results"] += info["rows"]
                if vname == "default":
                    result["engine"], result["engine_notes"] = engine, notes
                    result["server_start_s"], result["startup"] = info.get("server_start_s"), info.get("startup")
                    result["shared_s"], result["goodput_search"] = info.get("shared_s"), info.get("goodput_search")
                    if not info["servable"]:
                        result.update(servable=False, reason=info["reason"], status_note=info["reason"])
                        return finish()
                    result["memory"] = info["memory"]
                    if bench.offline:
                        with measuring():
                            result["offline"] = offline(
                                served, engine, next((w for w in workloads if w.kind == "fixed"), workloads[0]), out
                            )
                    if bench.server_starts > 1:
                        again = _further_starts(bench, info, lambda name, b: serve(name, served, engine, b))
                        result["server_starts"] = [_start_info(1, info)] + [_start_info(k, a) for k, a in again]
                        failed_variants += [f"default's server start {k}" for k, a in again if not a["servable"]]
                        further = [a["rows"] for _, a in again if a["rows"]]
                        pooled = pool_starts([info["rows"], *further], bench.slo)
                        result["results"] = [r for r in result["results"] if r["variant"] != "default"] + pooled
                        if result["goodput_search"]:
                            result["goodput_search"] = pool_search(result["goodput_search"], pooled, further, bench.slo)
                elif not info["servable"]:
                    failed_variants.append(vname)

        if lora_flags:
            base_dir = Path(inp.base.model)
            engine, notes = effective_engine(bench.engine, inp, base_dir, plat, need)
            info = serve("lora", base_dir, engine, extra_args=lora_flags, lora_names=lora_names)
            merged_rows = [r for r in result["results"] if r["variant"] == "default"]
            result["lora"] = {
                "servable": info["servable"],
                "reason": info["reason"],
                "adapters": {n: a.path for n, a in zip(lora_names, inp.adapters)},
                "engine": {**engine, "lora_flags": lora_flags},
                "server_start_s": info.get("server_start_s"),
                "memory": info.get("memory"),
                "port": info.get("port"),
                "results": info["rows"],
                "comparison": compare_lora(info["rows"], merged_rows),
                "notes": lora_notes + notes,
                "log": info["log"],
            }
    finally:
        client.close()

    result["best"] = pick_best(result["results"], bench)
    found = result.get("goodput_search")
    within = found and found["concurrency"] and found.get("slo_met") is not False  # False: pooled starts miss it
    if within and (found["goodput"] or 0) > (result["best"].get("goodput") or 0):
        result["best"] = {
            "variant": "default",
            "concurrency": found["concurrency"],
            "goodput": found["goodput"],
            "goodput_ci95": found["goodput_ci95"],
            "search": True,
            "reason": f"the goodput search's highest concurrency within the SLO on workload {found['workload']!r} "
            f"(up to {found['bound']}, to within 10 %): {found['goodput'] or 0:.3g} req/s at concurrency {found['concurrency']}",
        }
    if failed_variants:
        result["status_note"] = "variants not servable here: " + ", ".join(failed_variants)
    return finish()
