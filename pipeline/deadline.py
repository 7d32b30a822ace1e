"""How long a stage may run: every stage has a deadline, so a run left alone at night never hangs without a word.

Without `--stage-timeout` each stage may run DEADLINE_FACTOR (10) times a pre-flight estimate of its time, and at least
MIN_DEADLINE_S (30 minutes); `--stage-timeout MINUTES` gives every stage that deadline instead, and `--stage-timeout 0`
none. A stage past its deadline is stopped with its processes and reported failed, naming the deadline. The estimate is
deliberately pessimistic, a sum of named terms: the model's floating-point work (2 x parameters per token) over the
tokens the stage pushes through it, at a slow device's rate, plus the bytes it reads and writes at a slow disk's rate,
plus vLLM server starts. `run --dry-run` prints each stage's deadline:

    quantpipe run recipes/demo.yaml --dry-run
"""

from __future__ import annotations

import os
from pathlib import Path

from .common.shape import ModelShape

DEADLINE_FACTOR = 10
MIN_DEADLINE_S = 30 * 60
UNKNOWN_DEADLINE_S = 6 * 3600  # a model whose config.json is not here yet (a hub model before its download)
# float32 matrix work per core, taken low: SmolLM2-135M's GPTQ over 32 x 128 tokens is estimated at 330 s on 2 cores,
# where it measured 76-167 s (docs/demo-model.md)
CPU_FLOPS_PER_CORE = 5e9
GPU_FLOPS = 20e12  # taken at a twentieth of an H100's bf16 peak
DISK_BYTES_S = 100e6  # a slow network disk
SERVER_START_S = 300  # a cold `vllm serve` on a GPU host took 199 s to become healthy, 32-70 s on a CPU
LM_EVAL_DOCS = 2000  # documents per task of a hub dataset when lm_eval.limit is unset (not counted before the run)
DOC_TOKENS = 512  # tokens of one lm-eval document (its choices or its generation included) or validation prompt
# forward passes over the calibration set per method (GPTQ: capture, then propagate; AWQ: its grid search per layer)
CALIBRATION_PASSES = {"gptq": 3, "w8a8-int8": 5, "fp8": 2, "rtn": 0}


def _lines(path: str) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def stage_terms(recipe, s, m: ModelShape, b: int, flops: float, docs: int | None = None) -> dict[str, float]:
    """Seconds per named cost of one step (`s`, a run/plan Step) on a model of shape `m` stored in `b` bytes/weight;
    `docs`: the lm-eval documents the tasks hold, where known."""
    per_token = 2 * m.params / flops
    weights_s = m.params * b / DISK_BYTES_S
    a = next((x for x in recipe.artifacts if x.name == s.artifact), None)
    if s.kind == "merge":
        return {"read and write the weights": 2 * weights_s, "merge check": 9 * DOC_TOKENS * per_token}
    if s.kind == "quantize":
        c = recipe.calibration
        passes = getattr(a, "n_grid", 0) + 3 if a.method == "awq" else CALIBRATION_PASSES.get(a.method, 5)
        if a.method == "fp8" and getattr(a, "mode", None) != "static":
            passes = 0
        h, inter = m.hidden, m.mlp
        return {
            "read and write the weights": 2 * weights_s,
            "calibration passes": passes * (c.num_samples * c.max_seq_len if c else 0) * per_token,
            "per-layer solves": m.layers * (6 * h**3 + inter**3) / flops if passes else 0,
        }
    if s.kind == "evaluate":
        ev = recipe.evaluation
        le, v, f = ev.lm_eval, ev.validation, ev.fidelity
        if docs is None and le:
            docs = len(le.tasks) * (le.limit or LM_EVAL_DOCS)
        tokens = (docs or 0) * DOC_TOKENS * (1 + (le.num_fewshot or 0)) if le else 0
        tokens += _lines(v.path) * (DOC_TOKENS + v.max_new_tokens) * 2 if v else 0  # and the baseline's logits
        tokens += 2 * f.max_tokens if f else 0
        terms = {"read the weights": 2 * weights_s, "tokens through the model": tokens * per_token}
        if s.inp.backend == "vllm":
            terms["server start"] = SERVER_START_S
        return terms
    if s.kind == "benchmark":
        bm = recipe.benchmark
        servers = (1 + len(bm.variants)) * bm.server_starts + (1 if recipe.adapters and bm.lora else 0)
        prompts = lambda w: bm.max_prompts if bm.precision else w.num_prompts  # noqa: E731
        tokens = sum(prompts(w) * (w.prefix_len + w.input_len + w.output_len) for w in bm.workloads)
        points = len(bm.concurrency) + (bm.goodput_search or 0)
        return {
            "server starts": servers * SERVER_START_S,
            "requests": servers * points * tokens * per_token,
            "offline measurements": (2 * DOC_TOKENS * 64 * per_token) if bm.offline else 0,
        }
    return {"copy, hash and verify the weights": 3 * weights_s}  # package


def estimate(recipe, steps, base_dir: str | Path | None, gpu: dict | None) -> dict[str, dict]:
    """Per step id: {"time_s": the estimate, "terms": seconds per cost}; {} when the model's shape is not known."""
    from .preflight import DTYPE_BYTES

    m = ModelShape.read(base_dir) if base_dir else None
    if m is None or not m.complete:
        return {}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    flops = GPU_FLOPS if gpu else CPU_FLOPS_PER_CORE * cores
    le = recipe.evaluation.lm_eval
    docs = None
    if le and any(s.kind == "evaluate" for s in steps):
        from .lm_tasks import local_documents

        docs = local_documents(le)
    out = {}
    for s in steps:
        terms = stage_terms(recipe, s, m, DTYPE_BYTES[recipe.base.dtype], flops, docs)
        out[s.id] = {"time_s": sum(terms.values()), "terms": terms}
    return out


def deadlines(estimates: dict, steps, stage_timeout_s: float | None) -> dict[str, float | None]:
    """Per step id: seconds it may run (None: no deadline). `stage_timeout_s`: --stage-timeout (0 turns deadlines off)."""
    if stage_timeout_s is not None:
        return {s.id: stage_timeout_s or None for s in steps}
    out = {}
    for s in steps:
        e = estimates.get(s.id)
        out[s.id] = max(MIN_DEADLINE_S, DEADLINE_FACTOR * e["time_s"]) if e else UNKNOWN_DEADLINE_S
    return out


def describe(seconds: float | None) -> str:
    """A deadline as the plan and the failure message show it."""
    if seconds is None:
        return "none"
    if seconds < 120:
        return f"{seconds:.3g} s"
    return f"{seconds / 60:.3g} min" if seconds < 5 * 3600 else f"{seconds / 3600:.3g} h"


def past_deadline(sid: str, seconds: float | None, explicit: bool, log_path) -> str:
    """The failure of a stage stopped at its deadline: which deadline, and how to give it longer."""
    why = (
        "--stage-timeout"
        if explicit
        else f"{DEADLINE_FACTOR}x its pre-flight estimate, at least {MIN_DEADLINE_S // 60} min"
    )
    return (
        f"{sid} ran longer than its deadline ({describe(seconds)}: {why}) and was stopped with its processes; nothing of "
        f"it was kept. If it needs longer, give it --stage-timeout MINUTES (0: no deadline) (its log: {log_path})"
    )
