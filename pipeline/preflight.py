"""Pre-flight: will each stage fit this machine? Estimated from the model's config and the recipe, before anything runs.

A stage that needs more memory or disk than the machine has is refused in a second, not failed an hour in. The
estimates are deliberately simple upper bounds, one named term per cost (the formulas: docs/architecture.md,
"Pre-flight"). Only stages that will run (cache misses, forced) are checked; every estimate goes into run.json next
to the peak the stage measured. `QUANTPIPE_PREFLIGHT=off` skips the refusal (not the record).

    quantpipe run recipes/demo.yaml --dry-run     # the plan, with each stage's estimate
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from .common.compute import compute_dtype
from .common.nvidia import nvidia_smi, visible_gpus
from .common.shape import ModelShape
from .common.vllm_support import GPU_OVERHEAD_BYTES, cpu_kv_bytes, eval_kv_bytes, gpu_kv_bytes
from .run.publish import unpublished

GIB = 2**30
RUNTIME_BYTES = {"quantize": int(1.5 * GIB), "serve": 3 * GIB}  # torch + libraries; vLLM's engine and API processes
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


class PreflightError(Exception):
    """A stage will not fit; the message names it, the estimate, what is there and what to change."""


# --- what the model is --------------------------------------------------------------------------


def artifact_bytes(a, m: ModelShape, b: int) -> int:
    """On-disk size of an artifact: quantized Linear weights at q bytes, embeddings and ignored modules at b."""
    if a is None:
        return m.params * b
    bits = getattr(a, "bits", 4 if a.method in ("awq", "rtn") else 8)
    group = getattr(a, "group_size", None)
    q = bits / 8 + (2 * 2 / group if group else 0)  # per-group scale and zero point
    unquantized = m.vocab * m.hidden * (1 if m.tied or "lm_head" not in a.ignore else 2)
    unquantized = min(unquantized, m.params)
    return int((m.params - unquantized) * q + unquantized * b)


# --- estimates ----------------------------------------------------------------------------------


def estimate(recipe, steps, base_dir: str, gpu: dict | None, ram_available: int | None = None) -> dict[str, dict]:
    """Per step id: {ram_bytes, gpu_bytes, disk_cache_bytes, disk_output_bytes, terms}; {} when the model is unknown."""
    from .stages.package import parse_size
    from .stages.quantize import SHARD_SIZE

    m = ModelShape.read(base_dir)
    if m is None or not m.complete:
        return {}
    b = DTYPE_BYTES[recipe.base.dtype]
    # quantize and the hf evaluation compute in float32 on a CPU without fast kernels for base.dtype
    work = recipe.base.dtype if gpu else compute_dtype(recipe.base.dtype, "cpu")
    wb = DTYPE_BYTES[work]
    P, h, L = m.params, m.hidden, m.layers
    arts = {a.name: a for a in recipe.artifacts}
    adapters = sum(
        _size(Path(a.path) / "adapter_model.safetensors") or _size(Path(a.path) / "adapter_model.bin")
        for a in recipe.adapters
    )
    c = recipe.calibration
    N, S = (c.num_samples, c.max_seq_len) if c else (0, 0)
    out = {}
    for s in steps:
        a = arts.get(s.artifact)
        terms: dict[str, int] = {}
        gpu_terms: dict[str, int] = {}
        disk_cache = disk_out = 0
        if s.kind == "merge":
            if recipe.adapters:
                terms = {"base in fp32": P * 4, "adapters": 2 * adapters, f"merged copy in {recipe.base.dtype}": P * b}
                disk_cache = P * b
        elif s.kind == "quantize":
            size = artifact_bytes(a, m, b)
            terms = {f"model in {work}": P * wb, "compressed copy at save": size}
            calibrated = not (a.method == "fp8" and a.mode != "static") and a.method != "rtn"
            if calibrated and c:
                terms["layer activations (2*N*S*h*b)"] = 2 * N * S * h * wb
                if a.method in ("gptq", "w8a8-int8"):
                    hess = (5 * h * h + (m.heads * m.head_dim) ** 2 + m.mlp**2) * 4
                    terms["GPTQ Hessians"] = hess * (L if a.pipeline == "basic" else 1)
                if a.method == "awq":
                    terms["AWQ activation cache"] = N * S * (2 * h + m.heads * m.head_dim + m.mlp) * 4
            if gpu:
                gpu_terms = {
                    "one decoder layer (x2)": 2 * m.layer_params * b,
                    "embeddings and lm_head": m.vocab * h * b * (1 if m.tied else 2),
                }
                gpu_terms |= {k: v for k, v in terms.items() if k.startswith(("GPTQ", "AWQ", "layer activations"))}
            disk_cache = size
        elif s.kind == "evaluate":
            dt, eb = (work, wb) if s.inp.backend == "hf" else (recipe.base.dtype, b)
            terms = {f"model in {dt}": P * eb}
            if a is not None and s.inp.backend == "hf" and not m.logits_rescaled:  # hf.load_head
                terms["baseline's output layer (for KL)"] = m.vocab * h * eb
            elif a is not None:
                terms["baseline (for KL)"] = P * eb
            if gpu:
                gpu_terms, terms = dict(terms), {"loading": P * b}
                le = recipe.evaluation.lm_eval
                if s.inp.backend == "vllm":
                    gpu_terms = eval_server_terms(le.gpu_memory_utilization if le else None, m, P * b, gpu)
        elif s.kind == "benchmark":
            weights = artifact_bytes(a, m, b)
            engines = [recipe.benchmark.engine] + [v.engine for v in recipe.benchmark.variants]
            if gpu:
                # a shared or retried server may also serve the baseline's LoRA comparison: the largest of its servers
                options = [server_terms(recipe.benchmark, e, m, weights, gpu) for e in engines]
                gpu_terms = max(options, key=lambda t: sum(v for k, v in t.items() if not k.startswith("_")))
            else:
                kv = max(_cpu_kv(recipe.benchmark, e, m, ram_available) for e in engines)
                terms = {"weights": weights, "KV cache": kv}
        elif s.kind == "package":
            size = artifact_bytes(a, m, b)
            terms = {"weights": size}
            disk_out = size  # the published copy
            # the cache's shards are hard links to the quantize entry's (5 GB), unless a smaller max_shard_size re-shards them
            disk_cache = size if parse_size(recipe.package.max_shard_size) < parse_size(SHARD_SIZE) else 0
        terms["runtime"] = RUNTIME_BYTES.get(s.env, RUNTIME_BYTES["quantize"])
        out[s.id] = {
            "ram_bytes": sum(terms.values()),
            "gpu_bytes": server_gpu_bytes(gpu_terms) if gpu_terms else None,
            "disk_cache_bytes": disk_cache,
            "disk_output_bytes": disk_out,
            "terms": terms,
            "gpu_terms": gpu_terms,
        }
    return out


def server_terms(bench, e, m: ModelShape, weights: int, gpu: dict) -> dict[str, int]:
    """A GPU benchmark server's memory, by term: weights + KV cache (the recipe's kv_cache_memory_bytes, or what
    quantpipe picks from the workloads) + what vLLM needs beside them on this card (measured on this host, else a
    default). Where the recipe sets gpu_memory_utilization alone, vLLM reserves that share of the card, which must hold
    the weights and one max_model_len sequence (`_needs`)."""
    bpt = m.kv_bytes_per_token(e.kv_cache_dtype)
    card = gpu.get("card_bytes") or gpu["total_bytes"]
    kv = e.kv_cache_memory_bytes or gpu_kv_bytes(bench, e, bpt, m.max_len)
    if kv is None:
        util = e.gpu_memory_utilization
        return {
            f"gpu_memory_utilization {util:g} of {card / GIB:.1f} GiB": int(util * card),
            "_needs": weights + bpt * (e.max_model_len or m.max_len or 2048),
        }
    over, how = gpu.get("server_overhead_bytes") or GPU_OVERHEAD_BYTES, gpu.get("server_overhead_from") or "default"
    terms = {"weights": weights, "KV cache": kv, f"CUDA graphs, activations, context ({how})": over}
    if e.gpu_memory_utilization is not None:  # vLLM starts only where that share of the card is free
        terms["_reserves"] = int(e.gpu_memory_utilization * card)
    return terms


def eval_server_terms(util: float | None, m: ModelShape, weights: int, gpu: dict) -> dict[str, int]:
    """The GPU memory of an evaluation's own vLLM server (evaluate/vllm.py sizes it the same way): with
    evaluation.lm_eval.gpu_memory_utilization, that share of the card; else weights + one max-length sequence of KV
    cache with headroom + vLLM's memory beside them."""
    card = gpu.get("card_bytes") or gpu["total_bytes"]
    if util is not None:
        return {f"gpu_memory_utilization {util:g} of {card / GIB:.1f} GiB": int(util * card), "_needs": weights}
    over, how = gpu.get("server_overhead_bytes") or GPU_OVERHEAD_BYTES, gpu.get("server_overhead_from") or "default"
    kv = eval_kv_bytes(m.kv_bytes_per_token(None) or 0, m.max_len)
    return {"weights": weights, "KV cache": kv, f"CUDA graphs, activations, context ({how})": over}


def server_gpu_bytes(gpu_terms: dict) -> int:
    """The GPU memory a server's terms add up to (what the scheduler grants): the larger of its sum and what it reserves."""
    return max(sum(v for k, v in gpu_terms.items() if not k.startswith("_")), gpu_terms.get("_reserves", 0))


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0


def _cpu_kv(bench, e, m: ModelShape, ram_available: int | None) -> int:
    """The CPU KV cache the benchmark stage will allocate: the recipe's, or its own pick (common/vllm_support.cpu_kv_bytes)
    for the longest workload, a validation workload's prompts counted at the longest the engine allows."""
    if e.kv_cache_memory_bytes:
        return e.kv_cache_memory_bytes
    max_len = e.max_model_len or m.max_len or 2048
    need = max((w.max_tokens or max_len for w in bench.workloads), default=max_len)
    bpt = m.kv_bytes_per_token(e.kv_cache_dtype)
    return cpu_kv_bytes(e.max_model_len, m.max_len, bpt, need, max(bench.concurrency), ram_available)[0]


# --- what the machine has -------------------------------------------------------------------------


def machine(cache_dir: Path, out_dir: Path, gpu_cap_bytes: int | None = None) -> dict:
    """Available memory (MemAvailable, within a cgroup limit), the first GPU's memory (at most `gpu_cap_bytes` of it,
    --gpu-memory) with what a vLLM server needs there beside weights and KV cache, free disk at both dirs."""
    ram = None
    try:
        import psutil

        ram = psutil.virtual_memory().available
    except Exception:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            ram = min(ram or 1 << 62, int(limit) - used)
    except (OSError, ValueError):
        pass
    gpu = gpu_memory(gpu_cap_bytes)
    if gpu:
        gpu["server_overhead_bytes"], gpu["server_overhead_from"] = server_overhead(cache_dir, gpu["name"])
    return {"ram_bytes": ram, "gpu": gpu, "disk": {"cache": _disk(cache_dir), "output": _disk(out_dir)}}


def gpu_memory(cap_bytes: int | None = None) -> dict | None:
    """The memory of the first GPU the stages will use, at most `cap_bytes` of it; None without one
    (CUDA_VISIBLE_DEVICES hiding every GPU: the stages compute on the CPU)."""
    # nvidia-smi lists every GPU whatever CUDA_VISIBLE_DEVICES says: ask for the first one the stages will use
    visible = visible_gpus()
    if visible == []:
        return None
    rows = nvidia_smi(
        "--query-gpu=memory.total,memory.free,name",
        "--format=csv,noheader,nounits",
        *(["-i", visible[0]] if visible else []),
    )
    try:
        total, free = (int(float(x)) * 2**20 for x in rows[0][:2])
        name = ", ".join(rows[0][2:])
    except (ValueError, IndexError):
        return None
    card = total
    if cap_bytes and cap_bytes < total:  # the run keeps to cap_bytes of the card: the rest is someone else's
        total, free = cap_bytes, max(0, free - (card - cap_bytes))
    return {"total_bytes": total, "free_bytes": free, "card_bytes": card, "name": name}


OVERHEAD_FILE = "gpu-server-overhead.json"  # in the stage cache's root: what a server needed beyond weights + KV


def server_overhead(cache_dir: Path, gpu_name: str) -> tuple[int, str]:
    """(bytes, where the figure comes from): the most a vLLM server measured on a GPU of this name needed beyond its
    weights and KV cache, with a margin, else GPU_OVERHEAD_BYTES."""
    try:
        seen = json.loads((Path(cache_dir) / OVERHEAD_FILE).read_text())[gpu_name]["max_bytes"]
        return int(seen * 1.1) + GIB // 2, f"measured on this {gpu_name}"
    except (OSError, ValueError, KeyError, TypeError):
        return GPU_OVERHEAD_BYTES, "default"


def learn_server_overhead(cache_dir: Path, metrics: dict) -> int | None:
    """Keep what a benchmark's servers measured beyond weights and KV cache (their `memory.overhead_gib`) for the
    GPU they ran on; the largest figure seen stays. Returns the bytes learned (None: nothing measured)."""
    from filelock import FileLock

    gpu = (metrics.get("platform_info") or {}).get("device")
    seen = [
        (v.get("memory") or {}).get("overhead_gib")
        for v in [*(metrics.get("variants") or {}).values(), metrics.get("lora") or {}]
        if isinstance(v, dict)
    ]
    seen = [x for x in seen if isinstance(x, (int, float)) and x > 0]
    if metrics.get("platform") != "cuda" or not gpu or not seen:
        return None
    new = int(max(seen) * GIB)
    path = Path(cache_dir) / OVERHEAD_FILE
    with FileLock(str(path) + ".lock"):
        try:
            known = json.loads(path.read_text())
        except (OSError, ValueError):
            known = {}
        entry = known.get(gpu) if isinstance(known.get(gpu), dict) else {}
        entry = {"max_bytes": max(new, int(entry.get("max_bytes") or 0)), "last_bytes": new}
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps({**known, gpu: entry}, indent=2))
        os.replace(tmp, path)
    return new


def _disk(p: Path) -> dict | None:
    p = Path(p).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return {"path": str(p), "free_bytes": shutil.disk_usage(p).free, "dev": os.stat(p).st_dev}
    except OSError:
        return None


# --- the verdict --------------------------------------------------------------------------------


def problems(recipe, estimates: dict, have: dict, to_build: set[str], to_publish: set[str] | None = None) -> list[str]:
    """Sentences for every stage in `to_build` that will not fit; [] when all do (or nothing is known). Disk: the stages
    to build write the cache, the packages `to_publish` (default: those to build) are copied into output_dir."""
    out, publish = [], to_build if to_publish is None else to_publish
    for sid, e in estimates.items():
        if sid not in to_build:
            continue
        ram = have.get("ram_bytes")
        if ram is not None and e["ram_bytes"] > ram:
            out.append(
                f"{sid} needs about {_gib(e['ram_bytes'])} of memory ({_terms(e['terms'])}) but {_gib(ram)} is available; "
                + _advice(recipe, sid, e["terms"])
            )
        g = have.get("gpu")
        if g and e["gpu_bytes"] is not None:
            needs = e["gpu_terms"].get("_needs")
            if e["gpu_bytes"] > g["free_bytes"]:
                out.append(
                    f"{sid} needs about {_gib(e['gpu_bytes'])} of GPU memory ({_terms(e['gpu_terms'])}) but {_gib(g['free_bytes'])} "
                    f"is free; " + _advice(recipe, sid, e["gpu_terms"])
                )
            elif needs and needs > e["gpu_bytes"]:
                knob = (
                    "evaluation.lm_eval.gpu_memory_utilization"
                    if sid.startswith("evaluate")
                    else "benchmark.engine.gpu_memory_utilization (or a smaller max_model_len)"
                )
                out.append(
                    f"{sid}: the weights and one max_model_len sequence of KV cache need about {_gib(needs)}, more than the "
                    f"{_gib(e['gpu_bytes'])} vLLM reserves; set a higher {knob}"
                )
    need = {
        "cache": sum(e["disk_cache_bytes"] for s, e in estimates.items() if s in to_build),
        "output": sum(e["disk_output_bytes"] for s, e in estimates.items() if s in publish),
    }
    disks = have.get("disk") or {}
    if disks.get("cache") and disks.get("output") and disks["cache"]["dev"] == disks["output"]["dev"]:
        need = {"cache": need["cache"] + need["output"], "output": 0}
    for where, n in need.items():
        d = disks.get(where)
        if d and n > d["free_bytes"]:
            knob = "cache_dir (or $QUANTPIPE_CACHE)" if where == "cache" else "output_dir"
            prune = " (`quantpipe cache prune` removes entries no recent run needs)" if where == "cache" else ""
            out.append(
                f"the run writes about {_gib(n)} to {d['path']} but {_gib(d['free_bytes'])} is free there; "
                f"free some space{prune} or point {knob} at a larger disk"
            )
    return out


def _advice(recipe, sid: str, terms: dict) -> str:
    kind = sid.split(":")[0]
    if kind == "quantize":
        tips = []
        if any(k.startswith(("layer activations", "AWQ")) for k in terms):
            tips.append(
                f"fewer calibration samples (calibration.num_samples, now {recipe.calibration.num_samples}) or shorter "
                f"sequences (calibration.max_seq_len, now {recipe.calibration.max_seq_len})"
            )
        if any(k.startswith("GPTQ") for k in terms):
            tips.append(
                "sequential onloading (pipeline: sequential, sequential_targets: [<DecoderLayer class>]) so one layer's Hessians exist at a time"
            )
        tips.append("a machine with more memory for the model itself")
        return "to fit: " + "; or ".join(tips)
    if kind == "benchmark" and "KV cache" in terms:
        return "to fit: a smaller benchmark.engine.kv_cache_memory_bytes or max_model_len, or benchmark.enabled: false on this machine"
    if kind == "benchmark":
        return "to fit: a lower benchmark.engine.gpu_memory_utilization, or free the GPU"
    if kind == "merge":
        return "to fit: merge on a machine with more memory once, then point base.model at the merged model and drop adapters"
    if kind == "evaluate" and any(k.startswith("gpu_memory_utilization") for k in terms):
        return "to fit: a lower evaluation.lm_eval.gpu_memory_utilization, or free the GPU"
    if kind == "evaluate":
        return "to fit: a machine with more memory, or evaluate fewer artifacts at once (--artifacts)"
    return "to fit: a machine with more memory"


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def _terms(terms: dict) -> str:
    return " + ".join(f"{k} {_gib(v)}" for k, v in terms.items() if not k.startswith("_") and v)


def record(estimates: dict, sid: str) -> dict | None:
    """The estimate as run.json keeps it (GiB)."""
    e = estimates.get(sid)
    if e is None:
        return None
    r = {k.replace("_bytes", "_gib"): round(v / GIB, 3) for k, v in e.items() if k.endswith("_bytes") and v is not None}
    r["terms_gib"] = {k: round(v / GIB, 3) for k, v in e["terms"].items() if v}
    return r


def actual_peak(metrics: dict) -> dict:
    """The largest peak_rss_gib / peak_gpu_gib anywhere in a stage's metrics (the worker's, a server's)."""
    peaks: dict[str, float] = {}

    def walk(x):
        if isinstance(x, dict):
            for k, v in x.items():
                if k in ("peak_rss_gib", "peak_gpu_gib") and isinstance(v, (int, float)):
                    peaks[k] = max(peaks.get(k, 0.0), float(v))
                else:
                    walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(metrics)
    return peaks


def check(
    recipe, steps, base_dir: str, cache_dir: Path, out_dir: Path, to_build: set[str], gpu_cap_bytes: int | None = None
) -> tuple[dict, dict]:
    """Estimate, compare, raise PreflightError on a stage that will not fit; return (estimates, machine)."""
    have = machine(cache_dir, out_dir, gpu_cap_bytes)
    est = estimate(recipe, steps, base_dir, have["gpu"], have["ram_bytes"])
    bad = problems(recipe, est, have, to_build, unpublished(steps, out_dir))
    if bad and os.environ.get("QUANTPIPE_PREFLIGHT", "").lower() not in ("off", "0", "false", "no"):
        raise PreflightError(
            "pre-flight: this run would not fit the machine:\n"
            + "\n".join(f"  - {p}" for p in bad)
            + "\n(estimates are upper bounds: `quantpipe run --dry-run` shows them; QUANTPIPE_PREFLIGHT=off runs anyway)"
        )
    return est, have


def available_gib(have: dict) -> dict:
    """What the machine had when the run started, as run.json keeps it."""
    g, d = have.get("gpu"), have.get("disk") or {}
    r = {"ram_gib": round(have["ram_bytes"] / GIB, 2) if have.get("ram_bytes") is not None else None}
    if g:
        r |= {"gpu_total_gib": round(g["total_bytes"] / GIB, 2), "gpu_free_gib": round(g["free_bytes"] / GIB, 2)}
    r |= {f"disk_{k}_free_gib": round(v["free_bytes"] / GIB, 2) for k, v in d.items() if v}
    return r
