"""An evaluation through quantpipe's vllm backend against `lm_eval --model vllm` on the same weights and engine.

The evaluate stage's lm-eval figures come from lm-eval's `local-completions` model talking to a `vllm serve`
(its own, or the benchmark's server when both run as one job). This runs lm-eval's in-process `vllm` model with
that server's engine arguments (read from the stage's `serve_command`) and compares, per task: every
loglikelihood (the largest difference), every greedy flag and generation, and the task metrics.

    python bench/bench_eval_agreement.py EVAL_OUT [--json RESULT.json]

EVAL_OUT is an evaluate stage's `out/` built with backend vllm (evaluation.json, lm_eval_results.json,
lm_eval_samples/). Run it with the serve environment's interpreter (lm_eval and vllm importable). Exit 0 when
every task's metrics are equal, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# `vllm serve` flags that are the server's, not the engine's
SERVER_ONLY = {"served_model_name", "host", "port", "enable_lora", "max_loras", "max_lora_rank", "lora_modules"}


def engine_args(serve_command: str) -> tuple[str, dict, list[str]]:
    """(model path, engine keyword arguments, flags left out) from a `vllm serve MODEL --flag value ...` line."""
    words = shlex.split(serve_command)
    assert words[:2] == ["vllm", "serve"], serve_command
    model, rest, kwargs, dropped = words[2], words[3:], {}, []
    i = 0
    while i < len(rest):
        key = rest[i].removeprefix("--").replace("-", "_")
        has_value = i + 1 < len(rest) and not rest[i + 1].startswith("--")
        value = rest[i + 1] if has_value else None
        i += 2 if has_value else 1
        if key in SERVER_ONLY:
            continue
        if value is None:
            kwargs[key.removeprefix("no_")] = not key.startswith("no_")
        elif "," in value or value.startswith("{"):
            dropped.append(f"--{key} {value}")  # lm-eval's model_args cannot carry it
        else:
            kwargs[key] = value
    return model, kwargs, dropped


def samples(path: Path) -> dict[int, list]:
    return {x["doc_id"]: x["resps"] for x in map(json.loads, path.read_text().splitlines())}


def compare(ours_dir: Path, cli_dir: Path, tasks: list[str]) -> dict:
    ours = json.loads((ours_dir / "lm_eval_results.json").read_text())["results"]
    cli = json.loads(next(cli_dir.rglob("results_*.json")).read_text())["results"]
    out = {}
    for task in tasks:
        mine = samples(ours_dir / "lm_eval_samples" / f"{task}.jsonl")
        theirs = samples(next(cli_dir.rglob(f"samples_{task}_*.jsonl")))
        worst, n_ll, greedy_diff, gen_diff = 0.0, 0, 0, 0
        for doc in sorted(set(mine) & set(theirs)):
            for (m,), (t,) in zip(mine[doc], theirs[doc], strict=True):
                if isinstance(t, list):  # loglikelihood: [logprob, is_greedy]
                    n_ll += 1
                    worst = max(worst, abs(float(t[0]) - float(m[0])))
                    greedy_diff += t[1] != m[1]
                else:
                    gen_diff += t != m
        metrics = {k: v for k, v in ours[task].items() if "stderr" not in k and k != "alias"}
        theirs_m = {k: v for k, v in cli[task].items() if "stderr" not in k and k != "alias"}
        out[task] = {
            "docs": len(mine),
            "docs_cli": len(theirs),
            "loglikelihoods": n_ll,
            "max_abs_loglik_diff": worst,
            "greedy_flags_differing": greedy_diff,
            "generations_differing": gen_diff,
            "metrics": metrics,
            "metrics_cli": theirs_m,
            "metrics_equal": metrics == theirs_m,
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("eval_out", type=Path)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    ev = json.loads((a.eval_out / "evaluation.json").read_text())
    s = ev["settings"]
    if s.get("backend") != "vllm":
        print(f"{a.eval_out}: built with backend {s.get('backend')}, not vllm", file=sys.stderr)
        return 2
    model, kwargs, dropped = engine_args(ev["engine"]["serve_command"])
    model_args = ",".join(
        [f"pretrained={model}", *(f"{k}={v}" for k, v in kwargs.items()), f"add_bos_token={s['add_bos']}"]
    )
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "lm_eval",
            "--model",
            "vllm",
            "--model_args",
            model_args,
            "--tasks",
            ",".join(s["tasks"]),
            "--batch_size",
            str(s["batch_size"]),
            "--seed",
            str(s["seed"]),
            "--output_path",
            tmp,
            "--log_samples",
        ]
        for flag, key in (("--include_path", "include_path"), ("--limit", "limit"), ("--num_fewshot", "num_fewshot")):
            if s.get(key) is not None:
                cmd += [flag, str(s[key])]
        if s.get("apply_chat_template"):
            cmd.append("--apply_chat_template")
        t0 = time.monotonic()
        p = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.monotonic() - t0
        if p.returncode:
            print((p.stdout + p.stderr)[-4000:], file=sys.stderr)
            return 1
        tasks = compare(a.eval_out, Path(tmp), s["tasks"])
    result = {
        "eval_out": str(a.eval_out),
        "shared_server": ev["engine"].get("shared"),
        "serve_command": ev["engine"]["serve_command"],
        "lm_eval_command": ev.get("lm_eval_command"),
        "cli_command": shlex.join(["lm_eval", *cmd[3:]]),
        "flags_not_passed": dropped,
        "cli_wall_s": round(wall, 1),
        "versions": ev.get("versions"),
        "tasks": tasks,
    }
    print(json.dumps(result, indent=1))
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))
    return 0 if all(t["metrics_equal"] for t in tasks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
