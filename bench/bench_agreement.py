#!/usr/bin/env python
"""The benchmark stage's served figures against a bare `vllm bench serve`, paired round by round on one server.

Each round runs the same workload twice against one `vllm serve`: (a) the benchmark stage's `measure` (its runs
through stages/benchmark/client.py: forked from one client process on a CUDA host, or with `--fork yes`; elsewhere
from a process of its own that imported vLLM before `measure` began, as the stage's first run does) and (b) a fresh `vllm bench serve` process with
hand-written arguments, alternating which goes first so that drift hits both alike. Prints every round and, per
figure (output throughput, mean TTFT, mean TPOT), quantpipe / direct - 1: the mean of the rounds' log-ratios with its
95 % t-interval (over rounds, so it holds the run-to-run spread), and the verdict against ±5 %: agree (every
interval inside), disagree (one wholly outside), unresolved (the spread too wide for the rounds run; the line says
how many it would need). Run it in the serve environment:

    .venv/serve/bin/python bench/bench_agreement.py --model .tiny/llama --rounds 12
    python bench/bench_agreement.py --model /tmp/qp/tiny/llama --rounds 20 --gpu        # on a GPU host
    .venv/serve/bin/python bench/bench_agreement.py --port 8000 --model-name tiny --tokenizer .tiny/llama --json r.json

`--port` measures a server that is already up (tests/test_benchmark.py does, on its shared server); `--json` writes
the rounds, the intervals, the verdict and `args_diff` (quantpipe's `vllm bench serve` arguments against the
hand-written ones, both as vLLM's parser reads them: empty when they mean the same run).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
AGREEMENT = 0.05
FIGURES = {  # quantpipe's row, vLLM's result JSON
    "output_throughput": (lambda r: r["output_throughput"], lambda d: d["output_throughput"]),
    "ttft_mean_ms": (lambda r: r["ttft_ms"]["mean"], lambda d: d["mean_ttft_ms"]),
    "tpot_mean_ms": (lambda r: r["tpot_ms"]["mean"], lambda d: d["mean_tpot_ms"]),
}


def paired_intervals(qp: list[dict], direct: list[dict]) -> dict[str, list[float]]:
    """Per figure, quantpipe / direct - 1 as [estimate, low, high]: the mean of the rounds' log-ratios, 95 % t-interval."""
    from scipy.stats import t

    res = {}
    for k, (a, b) in FIGURES.items():
        logs = [math.log(a(q) / b(d)) for q, d in zip(qp, direct)]
        m = statistics.mean(logs)
        h = t.ppf(0.975, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else math.inf
        res[k] = [math.exp(m) - 1, math.exp(m - h) - 1, math.exp(m + h) - 1]
    return res


def verdict(iv: dict[str, list[float]], bound: float = AGREEMENT) -> str:
    """ "agree": every interval within ±bound; "disagree": one wholly outside; else "unresolved"."""
    if any(lo > bound or hi < -bound for _, lo, hi in iv.values()):
        return "disagree"
    return "agree" if all(-bound <= lo and hi <= bound for _, lo, hi in iv.values()) else "unresolved"


def rounds_needed(qp: list[dict], direct: list[dict], bound: float = AGREEMENT) -> int:
    """Rounds after which, at the spread and the mean seen, every figure's 95 % interval (about ±2 standard errors)
    clears the bound on one side: wholly inside ±bound, or wholly outside it; a mean on the bound itself never
    resolves (capped at 1000)."""
    need = 2
    for a, b in FIGURES.values():
        logs = [math.log(a(q) / b(d)) for q, d in zip(qp, direct)]
        room = abs(math.log(1 + bound) - abs(statistics.mean(logs)))  # from the mean to the nearer side of the bound
        need = max(need, math.ceil((2 * statistics.stdev(logs) / room) ** 2) if room > 0 else 1000)
    return min(need, 1000)


def _direct_args(port: int, model: str, tokenizer: str, a: argparse.Namespace) -> list[str]:
    return [  # written out by hand: what a user would type
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        model,
        "--tokenizer",
        tokenizer,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(a.input_len),
        "--random-output-len",
        str(a.output_len),
        "--num-prompts",
        str(a.num_prompts),
        "--max-concurrency",
        str(a.concurrency),
        "--ignore-eos",
        "--temperature",
        "0",
        "--seed",
        "0",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,90,99",
        "--save-result",
        "--save-detailed",
        "--disable-tqdm",
    ]


def _rounds(srv, model: str, tokenizer: str, a: argparse.Namespace, out: Path) -> dict:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from quantpipe.recipe import Benchmark
    from quantpipe.stages.benchmark.bench_serve import bench_serve_args
    from quantpipe.stages.benchmark.client import BenchClient
    from quantpipe.stages.benchmark.measure import measure

    bench = Benchmark.model_validate(
        {
            "workloads": [
                {"name": "fixed", "input_len": a.input_len, "output_len": a.output_len, "num_prompts": a.num_prompts}
            ],
            "concurrency": [a.concurrency],
        }
    )
    direct_args = _direct_args(srv.port, model, tokenizer, a)

    def parsed(args: list[str]) -> dict:
        p = FlexibleArgumentParser()
        add_cli_args(p)
        return vars(p.parse_args(args + ["--result-dir", "R", "--result-filename", "F"]))

    qa = parsed(
        bench_serve_args(srv, bench.workloads[0], None, a.concurrency, tokenizer, bench.seed, Path("R"), "F", [])
    )
    da = parsed(direct_args)
    res = {
        "args_diff": {
            k: [str(qa.get(k)), str(da.get(k))]
            for k in set(qa) | set(da)
            if qa.get(k) != da.get(k) and k != "request_id_prefix"
        },
        "quantpipe": [],
        "direct": [],
    }
    with BenchClient(out / "client.log", fork={"auto": None, "yes": True, "no": False}[a.fork]) as client:

        def quantpipe_run(i: int) -> None:
            client.ready()  # as the stage's first run: its process has imported vLLM before `measure` begins
            rows, _ = measure(srv, bench, f"qp{i}", list(bench.workloads), {}, tokenizer, out, client=client)
            res["quantpipe"].append(rows[0])

        def direct_run(i: int) -> None:
            urllib.request.urlopen(
                urllib.request.Request(f"{srv.url}/reset_prefix_cache", data=b"", method="POST")
            ).read()
            args = direct_args + ["--result-dir", str(out / "direct"), "--result-filename", f"{i}.json"]
            subprocess.run(
                [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", *args],
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            res["direct"].append(json.loads((out / "direct" / f"{i}.json").read_text()))

        for i in range(max(a.rounds, a.max_rounds or 0)):
            for run in (quantpipe_run, direct_run) if i % 2 == 0 else (direct_run, quantpipe_run):
                run(i)
            q, d = res["quantpipe"][-1], res["direct"][-1]
            print(
                f"round {i + 1:2d}: "
                + "  ".join(f"{k} {fa(q):8.2f} / {fb(d):8.2f}" for k, (fa, fb) in FIGURES.items()),
                flush=True,
            )
            if i + 1 >= a.rounds and verdict(paired_intervals(res["quantpipe"], res["direct"])) != "unresolved":
                break
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory to serve (or, with --port, the tokenizer's default)")
    p.add_argument("--port", type=int, help="measure the server already listening on this port instead of starting one")
    p.add_argument("--model-name", default="model", help="served model name (with --port: the server's)")
    p.add_argument("--tokenizer", help="default: --model")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument(
        "--max-rounds",
        type=int,
        default=None,
        help="go on after --rounds, a round at a time, until the verdict resolves or this many rounds ran",
    )
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--gpu", action="store_true", help="a CUDA host: no CPU KV-cache size, no --enforce-eager")
    p.add_argument(
        "--fork",
        choices=("auto", "yes", "no"),
        default="auto",
        help="quantpipe's runs forked from one client (yes), fresh processes (no), or as the stage does here (auto)",
    )
    p.add_argument("--out", type=Path, help="where results and logs go (default: a temporary folder)")
    p.add_argument("--json", type=Path, help="also write the rounds, intervals and verdict here")
    a = p.parse_args()
    if a.rounds < 2 or not (a.model or (a.port and a.tokenizer)):
        p.error("needs --model (or --port with --tokenizer) and at least 2 rounds")
    sys.path.insert(0, str(REPO / "pipeline"))
    import worker  # pipeline/worker.py: loads quantpipe from the folder it sits in

    worker._bootstrap()
    from quantpipe.server import Server

    out = a.out or Path(tempfile.mkdtemp(prefix="bench-agreement-"))
    tokenizer = a.tokenizer or a.model
    if a.port:
        res = _rounds(Server.connect(a.port, a.model_name), a.model_name, tokenizer, a, out)
    else:
        flags = ["--dtype", "bfloat16", "--max-model-len", "2048"]
        flags += [] if a.gpu else ["--enforce-eager", "--kv-cache-memory-bytes", str(256 * 2**20)]
        with Server(
            a.model,
            flags,
            log_path=out / "server.log",
            served_model_name=a.model_name,
            env={"VLLM_SERVER_DEV_MODE": "1"},
            gpu=a.gpu,
        ) as srv:
            rounds = f"{a.rounds} to {a.max_rounds}" if (a.max_rounds or 0) > a.rounds else str(a.rounds)
            print(
                f"server up in {srv.start_s:.1f} s; {rounds} rounds of {a.num_prompts} prompts "
                f"({a.input_len} in, {a.output_len} out) at concurrency {a.concurrency}",
                flush=True,
            )
            res = _rounds(srv, a.model_name, tokenizer, a, out)
    iv = paired_intervals(res["quantpipe"], res["direct"])
    res |= {"intervals": iv, "verdict": verdict(iv), "rounds_needed": rounds_needed(res["quantpipe"], res["direct"])}
    if res["verdict"] == "unresolved":  # the t-interval of few rounds is wider than the estimate's ±2 standard errors
        res["rounds_needed"] = max(res["rounds_needed"], len(res["quantpipe"]) + 1)
    for k, (e, lo, hi) in iv.items():
        print(f"{k:18s} quantpipe / direct - 1 = {e:+.1%}  95% [{lo:+.1%}, {hi:+.1%}]")
    print(
        f"verdict at ±{AGREEMENT:.0%}: {res['verdict']} after {len(res['quantpipe'])} rounds"
        + (f" (this spread needs about {res['rounds_needed']})" if res["verdict"] == "unresolved" else "")
        + ("" if not res["args_diff"] else f"; arguments differ: {res['args_diff']}")
    )
    if a.json:
        a.json.write_text(json.dumps(res))


if __name__ == "__main__":
    main()
