"""What quantpipe says to `vllm bench serve` and reads back from it: the argument list of one run (the workload's
dataset, the concurrency, the seed, the SLO as `--goodput` bounds, the percentiles to report), the run itself through a
`BenchClient`, and the run's result JSON turned into quantpipe's result row (latencies in ms, with the 95% intervals of
`stats.intervals`) and checked against the SLO. vLLM's CLI contract lives in this one place, so a change in the flags it
takes or the fields it writes is made here, not in the sweep (measure.py).

    args = bench_serve_args(srv, w, None, 4, tokenizer, 0, raw_dir, "fixed-c4.json", slo_goodput_args(bench.slo))
    row = row_from_vllm(json.loads((raw_dir / "fixed-c4.json").read_text()), bench.slo)  # {"ttft_ms": {"p99": ...}, ...}
"""

from __future__ import annotations

from pathlib import Path

from ...recipe import SLO, Workload
from ...server import Server
from .. import StageError
from .client import BenchClient
from .stats import intervals
from .workloads import dataset_args

PERCENTILES = (50, 90, 99)
METRICS = ("ttft", "tpot", "itl", "e2el")


def slo_goodput_args(s: SLO) -> list[str]:
    """vLLM's --goodput bounds for the SLO ([] without one)."""
    pairs = [
        f"{k}:{v:g}"
        for k, v in (("ttft", s.ttft_p99_ms), ("tpot", s.tpot_p99_ms), ("e2el", s.e2el_p99_ms))
        if v is not None
    ]
    return ["--goodput", *pairs] if pairs else []


def bench_serve_args(
    srv: Server,
    w: Workload,
    data: dict | None,
    concurrency: int,
    tokenizer: str,
    seed: int,
    result_dir: Path,
    filename: str,
    goodput: list[str],
    lora_names: list[str] | None = None,
) -> list[str]:
    """The `vllm bench serve` argument list for one run (what the CLI would be given after `bench serve`)."""
    args = [
        "--backend",
        "openai",
        "--host",
        "127.0.0.1",
        "--port",
        str(srv.port),
        "--endpoint",
        "/v1/completions",
        "--model",
        srv.served_model_name,
        "--tokenizer",
        tokenizer,
        *dataset_args(w, data),
        "--num-prompts",
        str(w.num_prompts),
        "--max-concurrency",
        str(concurrency),
        "--request-rate",
        "inf",
        "--ignore-eos",
        "--temperature",
        "0",
        "--seed",
        str(seed),
        "--percentile-metrics",
        ",".join(METRICS),
        "--metric-percentiles",
        ",".join(map(str, PERCENTILES)),
        *goodput,
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        filename,
        "--disable-tqdm",
    ]
    if lora_names:
        args += ["--lora-modules", *lora_names, "--lora-assignment", "round-robin"]
    return args


def vllm_bench_serve(client: BenchClient, args: list[str], log_path: Path) -> None:
    """Run `vllm bench serve ARGS`, vLLM's own CLI, through `client` (see client.py), output in `log_path`."""
    rc = client.run(args, log_path)
    if rc != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
        raise RuntimeError(f"vllm bench serve failed (exit {rc}); last lines of {log_path}:\n{tail}")


def require_completed(raw: dict, what: str, log_path: Path) -> None:
    """`vllm bench serve` exits 0 even when every request failed (it warns "All requests failed"): a run
    that completed nothing has no figures to report, so the stage stops there and says where to look."""
    if raw.get("completed"):
        return
    errors = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines() if "Error" in ln or "error" in ln]
    raise StageError(
        f"vllm bench serve completed none of the requests of {what}: {raw.get('failed')} failed"
        + (f" ({errors[-1][:300]})" if errors else "")
        + f"; the requests' errors are in {log_path}"
    )


def row_from_vllm(raw: dict, slo: SLO | None = None) -> dict:
    """vLLM's result JSON -> quantpipe's result row (latencies in ms, p50/p90/p99), with the 95% intervals of
    `stats.intervals` where the result carries its requests (`p50_ci95`/`p99_ci95` per latency, `ci95` per rate)."""
    row = {
        "completed": raw.get("completed"),
        "failed": raw.get("failed"),
        "duration_s": raw.get("duration"),
        "request_throughput": raw.get("request_throughput"),
        "output_throughput": raw.get("output_throughput"),
        "total_token_throughput": raw.get("total_token_throughput"),
    }
    for m in METRICS:
        row[f"{m}_ms"] = {"mean": raw.get(f"mean_{m}_ms"), **{f"p{p}": raw.get(f"p{p}_{m}_ms") for p in PERCENTILES}}
    iv = intervals(raw, slo)
    if iv:
        for m in ("ttft", "tpot", "e2el"):
            row[f"{m}_ms"] |= {f"{p}_ci95": ci for p, ci in iv.get(f"{m}_ms", {}).items()}
        row["ci95"], row["ci_requests"], row["ci_method"] = iv["ci95"], iv["n"], iv["method"]
    done = raw.get("completed") or 0
    row["input_tokens_mean"] = raw.get("total_input_tokens", 0) / done if done else None
    row["output_tokens_mean"] = raw.get("total_output_tokens", 0) / done if done else None
    return row


def slo_met(row: dict, s: SLO) -> bool | None:
    """p99s within the SLO and no failed request (None without an SLO)."""
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
