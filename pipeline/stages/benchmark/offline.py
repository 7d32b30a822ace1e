"""Offline benches of the default engine (`benchmark.offline`): `vllm bench latency` (batch 1) and `vllm bench throughput`,
each in a fresh vLLM process on the first `fixed` workload's lengths (or the first workload's); JSON under out/offline/.

    offline(served_dir, engine, workload, out)   # {"latency_s_batch1": ..., "throughput_req_s": ...}
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ...common.vllm_support import engine_flags
from ...recipe import Workload
from ...server_output import failure_reason
from .client import run_logged


def offline(model: Path, engine: dict, w: Workload, out: Path) -> dict:
    """`vllm bench latency` (batch 1) and `vllm bench throughput`, each in its own engine process."""
    import sys

    res: dict = {"input_len": w.input_len, "output_len": w.output_len, "num_prompts": w.num_prompts}
    flags = engine_flags(engine)
    runs = {
        "latency": [
            "--input-len",
            str(w.input_len),
            "--output-len",
            str(w.output_len),
            "--batch-size",
            "1",
            "--num-iters-warmup",
            "2",
            "--num-iters",
            "5",
        ],
        # --random-*: vLLM 0.32's throughput bench prefers its --random-input-len default (1024) over --input-len.
        "throughput": [
            "--dataset-name",
            "random",
            "--random-input-len",
            str(w.input_len),
            "--random-output-len",
            str(w.output_len),
            "--random-range-ratio",
            "0.0",
            "--num-prompts",
            str(w.num_prompts),
        ],
    }
    for kind, extra in runs.items():
        js = out / "offline" / f"{kind}.json"
        js.parent.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.cli.main",
            "bench",
            kind,
            "--model",
            str(model),
            *extra,
            *flags,
            "--output-json",
            str(js),
        ]
        t0 = time.perf_counter()
        rc = run_logged(cmd, out / "logs" / f"offline-{kind}.log")
        res[f"{kind}_wall_s"] = round(time.perf_counter() - t0, 2)
        if rc != 0 or not js.is_file():
            res["error"] = f"vllm bench {kind} failed (exit {rc}): " + failure_reason(
                (out / "logs" / f"offline-{kind}.log").read_text(errors="replace")
            )
            return res
        data = json.loads(js.read_text())
        if kind == "latency":
            pct = data.get("percentiles") or {}
            res |= {
                "latency_s_batch1": data.get("avg_latency"),
                "latency_s_p50": pct.get("50"),
                "latency_s_p99": pct.get("99"),
            }
        else:
            rps = data.get("requests_per_second")
            res |= {
                "throughput_req_s": rps,
                "throughput_tok_s": data.get("tokens_per_second"),
                "throughput_output_tok_s": rps * w.output_len if rps else None,
            }
    return res
