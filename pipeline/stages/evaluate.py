"""Evaluate stage: score the baseline and every artifact through one path, and compare them.

The unquantized merged model (`baseline`) and each quantized artifact go through exactly the same
code with the same settings: lm-eval (its Python API, `simple_evaluate`, the `hf` backend), the
user's validation set (greedy generation, scored per row), and, for artifacts, token-level fidelity
against the baseline on the validation prompts (perplexity of the references, mean KL divergence of
the next-token distributions, top-1 agreement). Per-example scores are kept (`per_example.json`) so
that an artifact's stage can pair them with the baseline's: recovery (artifact/baseline) with a
paired bootstrap 95% CI, and the flip rate. `check_gates` turns those figures into a release
decision; it is light (no heavy imports) because the runner calls it.

    quantpipe run recipes/demo.yaml --stages evaluate

Outputs in `out/`: evaluation.json (the metrics returned), lm_eval_results.json and
lm_eval_samples/<task>.jsonl (written by lm-eval's own EvaluationTracker, as `lm_eval --output_path
--log_samples` writes them), validation_outputs.jsonl (each row's output and score), per_example.json
(per-example scores and example ids, in doc order, that the artifacts' stages pair with).

Backends (`evaluation.lm_eval.backend`; `auto` is vllm where a CUDA GPU is present, else hf):
- `hf`: lm-eval's hf model; validation and fidelity through transformers, which reads every artifact
  (it decompresses compressed-tensors); the artifact's stage loads the baseline model for the full KL.
- `vllm`: the stage runs in the serve environment. lm-eval's own vllm model (its figures are those of
  `lm_eval --model vllm` with the same arguments, written to evaluation.json as `lm_eval_command`);
  its engine then generates the validation outputs (greedy) and gives the prompt logprobs of the
  references. The baseline keeps its logprobs (`fidelity_reference.json`) and an artifact's stage
  compares against them, one engine per stage. vLLM returns the top 20 logprobs per position, so the
  KL is over those plus one bucket for the rest: a lower bound of the full KL (`kl_topk`); top-1
  agreement and perplexity are exact. A scheme vLLM cannot run on this machine is refused before
  the engine starts (use hf for it).
BOS is passed explicitly as the tokenizer's own rule, and an artifact whose tokenizer, BOS rule, chat
template, backend or evaluation settings differ from the baseline's is refused rather than compared.
Fidelity needs `evaluation.validation` (its prompts and references).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import StageError

if TYPE_CHECKING:
    from ..recipe import Gates, Recipe

log = logging.getLogger(__name__)

METRICS = ("exact_match", "contains", "regex", "json_valid")
BOOTSTRAP_SEED = 0
PROBE = "Hello world! 12 + 30 = 42.\nThe end."  # tokenized by baseline and artifact: must give the same ids
VLLM_LOGPROBS = 20  # prompt logprobs per position for fidelity under vllm: vLLM's default max_logprobs
VLLM_ENV = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")  # recorded with the engine


# --- gates (light: the runner imports this in the CLI's process) --------------------------------


def check_gates(gates: Gates, metrics: dict) -> list[str]:
    """Sentences naming each gate the metrics fail; [] when all pass (and for the baseline itself).

    min_recovery applies to every compared task metric (validation included); an entry of
    min_recovery_per_task replaces it for that task. A gate that cannot be checked (no comparison,
    recovery undefined because the baseline scored 0, no fidelity figures) fails: a release gate
    must not pass by default.
    """
    if not metrics or metrics.get("artifact") in (None, "baseline"):
        return []
    failures: list[str] = []
    comparison = metrics.get("comparison") or []
    per_task = dict(gates.min_recovery_per_task or {})
    if gates.min_recovery is not None or per_task:
        seen = {c["task"] for c in comparison}
        for task in sorted(set(per_task) - seen):
            failures.append(
                f"min_recovery_per_task names {task!r}, which was not evaluated (evaluated: {', '.join(sorted(seen)) or 'nothing'}); "
                "fix the task name or add the task to evaluation.lm_eval.tasks"
            )
        for c in comparison:
            floor = per_task.get(c["task"], gates.min_recovery)
            if floor is None:
                continue
            gate = "min_recovery_per_task" if c["task"] in per_task else "min_recovery"
            r = c.get("recovery")
            if r is None:
                failures.append(
                    f"{c['task']} {c['metric']} recovery is undefined (baseline {_fmt(c.get('baseline'))}, artifact "
                    f"{_fmt(c.get('artifact'))}), so {gate} {floor:g} cannot be checked; use a task the baseline scores on"
                )
            elif r < floor:
                ci = c.get("ci95")
                ci_txt = f" (95% CI {ci[0]:.3f}-{ci[1]:.3f}, n={c.get('n')})" if ci and None not in ci else ""
                failures.append(f"{c['task']} {c['metric']} recovery {r:.3f}{ci_txt} < {gate} {floor:g}")
    fid = metrics.get("fidelity")
    for gate, key, worse in (("max_kl", "kl_mean", lambda v, lim: v > lim), ("min_top1_agreement", "top1_agreement", lambda v, lim: v < lim)):
        lim = getattr(gates, gate)
        if lim is None:
            continue
        value = (fid or {}).get(key)
        if value is None:
            failures.append(f"{gate} {lim:g} cannot be checked: no fidelity figures (they need evaluation.validation prompts)")
        elif worse(value, lim):
            failures.append(f"{key} {value:.4g} {'>' if gate == 'max_kl' else '<'} {gate} {lim:g}")
    return failures


def _fmt(v) -> str:
    return "n/a" if v is None else f"{v:.4g}"


# --- validation set: reading and scoring (no heavy imports) -----------------------------------


def load_validation(path: str | Path, default_metric: str, schema_path: str | None = None) -> list[dict]:
    """Read and check a validation JSONL; a bad row raises StageError naming file:line."""
    p = Path(path)
    if not p.is_file():
        raise StageError(f"evaluation.validation.path: {p} does not exist; point it at a JSONL file")
    rows = []
    with open(p, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{p}:{line_no}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise StageError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); each line must be one JSON object") from None
            if not isinstance(row, dict):
                raise StageError(f"{where}: expected a JSON object with `prompt` (or `messages`) and `reference`, got {type(row).__name__}")
            has_prompt, has_msgs = "prompt" in row, "messages" in row
            if has_prompt == has_msgs:
                raise StageError(f"{where}: give exactly one of `prompt` (text) or `messages` (chat turns)")
            if has_prompt and not (isinstance(row["prompt"], str) and row["prompt"]):
                raise StageError(f"{where}: `prompt` must be a non-empty string")
            if has_msgs:
                msgs = row["messages"]
                if not (isinstance(msgs, list) and msgs and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs)):
                    raise StageError(f"{where}: `messages` must be a non-empty list of {{\"role\": ..., \"content\": ...}} objects with string values")
            metric = row.get("metric", default_metric)
            if metric not in METRICS:
                raise StageError(f"{where}: unknown metric {metric!r}; use one of {', '.join(METRICS)}")
            ref = row.get("reference")
            if metric != "json_valid" or ref is not None:
                if not isinstance(ref, str) or not ref.strip():
                    raise StageError(f"{where}: `reference` must be a non-empty string (metric {metric})")
            if metric == "regex":
                try:
                    re.compile(ref)
                except re.error as e:
                    raise StageError(f"{where}: `reference` is not a valid regular expression ({e}); escape it or use metric contains") from None
            rows.append({**row, "metric": metric, "_where": where, "_line": line_no})
    if not rows:
        raise StageError(f"{p}: no rows; add JSON lines with `prompt` and `reference`")
    if schema_path:
        schema = _load_schema(schema_path)
        for r in rows:
            r["_schema"] = schema
    return rows


def score_output(output: str, row: dict) -> float:
    """1.0 when the model's output satisfies the row's metric, else 0.0."""
    metric, ref = row["metric"], row.get("reference")
    if metric == "exact_match":
        return float(output.strip() == ref.strip())
    if metric == "contains":
        return float(ref.strip() in output)
    if metric == "regex":
        return float(re.search(ref, output) is not None)
    if metric == "json_valid":
        text = output.strip()
        m = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", text, re.S)  # models like to fence JSON
        try:
            value = json.loads(m.group(1) if m else text)
        except ValueError:
            return 0.0
        schema = row.get("_schema")
        return float(schema is None or not schema_errors(value, schema))
    raise StageError(f"unknown metric {metric!r}; use one of {', '.join(METRICS)}")


_SCHEMA_KEYS = {
    "$schema", "$id", "title", "description", "default", "examples", "type", "properties", "required",
    "additionalProperties", "items", "enum", "const", "minItems", "maxItems", "minLength", "maxLength",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "pattern", "anyOf", "oneOf", "allOf",
}


def _load_schema(path: str) -> dict:
    p = Path(path)
    try:
        schema = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise StageError(f"evaluation.validation.json_schema: cannot read {p} as JSON ({e}); give a JSON Schema file") from None
    if not isinstance(schema, dict):
        raise StageError(f"evaluation.validation.json_schema: {p} must hold a JSON object (a JSON Schema)")
    import importlib.util

    if importlib.util.find_spec("jsonschema") is not None:
        return schema  # full Draft 2020-12 support where installed
    unknown = sorted(_schema_keywords(schema) - _SCHEMA_KEYS)
    if unknown:
        raise StageError(
            f"evaluation.validation.json_schema: {p} uses {', '.join(unknown)}, which quantpipe's built-in checker does not "
            f"support (the jsonschema package is not installed); it supports {', '.join(sorted(_SCHEMA_KEYS - {'$schema', '$id', 'title', 'description', 'default', 'examples'}))}"
        )
    return schema


def _schema_keywords(s) -> set[str]:
    if not isinstance(s, dict):
        return set()
    keys = set(s)
    for k, v in s.items():
        if k == "properties" and isinstance(v, dict):
            for sub in v.values():
                keys |= _schema_keywords(sub)
        elif k in ("items", "additionalProperties"):
            keys |= _schema_keywords(v)
        elif k in ("anyOf", "oneOf", "allOf") and isinstance(v, list):
            for sub in v:
                keys |= _schema_keywords(sub)
    return keys


def schema_errors(value, schema: dict, where: str = "$") -> list[str]:
    """Where `value` breaks `schema` (jsonschema where installed, else a subset of JSON Schema)."""
    try:
        import jsonschema

        return [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(value)]
    except ImportError:
        return _check(value, schema, where)


_TYPES = {
    "object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list), "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and v.is_integer(),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


def _check(v, s, where: str) -> list[str]:
    if s is True or s == {}:
        return []
    if s is False:
        return [f"{where}: not allowed"]
    errs = []
    t = s.get("type")
    if t is not None:
        types = t if isinstance(t, list) else [t]
        if not any(_TYPES.get(x, lambda _: False)(v) for x in types):
            return [f"{where}: expected {t}"]
    if "enum" in s and v not in s["enum"]:
        errs.append(f"{where}: not one of {s['enum']}")
    if "const" in s and v != s["const"]:
        errs.append(f"{where}: must be {s['const']!r}")
    if isinstance(v, dict):
        props = s.get("properties", {})
        errs += [f"{where}: missing {k!r}" for k in s.get("required", []) if k not in v]
        for k, sub in v.items():
            if k in props:
                errs += _check(sub, props[k], f"{where}.{k}")
            elif "additionalProperties" in s:
                errs += _check(sub, s["additionalProperties"], f"{where}.{k}")
    if isinstance(v, list):
        if "minItems" in s and len(v) < s["minItems"] or "maxItems" in s and len(v) > s["maxItems"]:
            errs.append(f"{where}: wrong number of items")
        if isinstance(s.get("items"), (dict, bool)):
            for i, sub in enumerate(v):
                errs += _check(sub, s["items"], f"{where}[{i}]")
    if isinstance(v, str):
        if "minLength" in s and len(v) < s["minLength"] or "maxLength" in s and len(v) > s["maxLength"]:
            errs.append(f"{where}: wrong length")
        if "pattern" in s and not re.search(s["pattern"], v):
            errs.append(f"{where}: does not match {s['pattern']!r}")
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        if "minimum" in s and v < s["minimum"] or "maximum" in s and v > s["maximum"]:
            errs.append(f"{where}: out of range")
        if "exclusiveMinimum" in s and v <= s["exclusiveMinimum"] or "exclusiveMaximum" in s and v >= s["exclusiveMaximum"]:
            errs.append(f"{where}: out of range")
    if "allOf" in s:
        for sub in s["allOf"]:
            errs += _check(v, sub, where)
    if "anyOf" in s and all(_check(v, sub, where) for sub in s["anyOf"]):
        errs.append(f"{where}: matches none of anyOf")
    if "oneOf" in s and sum(not _check(v, sub, where) for sub in s["oneOf"]) != 1:
        errs.append(f"{where}: must match exactly one of oneOf")
    return errs


# --- paired comparison ------------------------------------------------------------------------


def compare(baseline: list[float], artifact: list[float], samples: int, higher_is_better: bool = True, seed: int = BOOTSTRAP_SEED) -> dict:
    """Recovery (artifact/baseline; baseline/artifact when lower is better) with a paired bootstrap 95% CI."""
    import numpy as np

    b, a = np.asarray(baseline, dtype=np.float64), np.asarray(artifact, dtype=np.float64)
    if b.shape != a.shape or b.ndim != 1 or len(b) == 0:
        raise ValueError(f"paired scores must be two equal-length non-empty lists, got {b.shape} and {a.shape}")
    n = len(b)
    mb, ma = float(b.mean()), float(a.mean())
    num, den = (ma, mb) if higher_is_better else (mb, ma)
    recovery = num / den if den != 0 else None
    ci = None
    if recovery is not None:
        rng = np.random.default_rng(seed)
        ratios = []
        chunk = max(1, min(samples, 20_000_000 // n))  # bound memory at ~160 MB of indices
        for start in range(0, samples, chunk):
            idx = rng.integers(0, n, size=(min(chunk, samples - start), n))
            rb, ra = b[idx].mean(axis=1), a[idx].mean(axis=1)
            top, bottom = (ra, rb) if higher_is_better else (rb, ra)
            with np.errstate(divide="ignore", invalid="ignore"):
                ratios.append(np.where(bottom != 0, top / np.where(bottom != 0, bottom, 1), np.nan))
        r = np.concatenate(ratios)
        r = r[np.isfinite(r)]
        if len(r):
            ci = [float(np.percentile(r, 2.5)), float(np.percentile(r, 97.5))]
    binary = bool(np.isin(b, (0.0, 1.0)).all() and np.isin(a, (0.0, 1.0)).all())
    return {
        "baseline": mb, "artifact": ma, "recovery": recovery, "ci95": ci,
        "flip_rate": float((b != a).mean()) if binary else None, "n": n,
    }


# --- the stage --------------------------------------------------------------------------------


def lm_eval_backend(recipe: Recipe) -> str:
    """The backend the stage uses: the recipe's; for `auto`, vllm where a CUDA GPU is present, else hf (light: the runner calls it)."""
    le = recipe.evaluation.lm_eval
    if le is None or le.backend == "hf":
        return "hf"
    if le.backend == "vllm":
        return "vllm"
    from ..envs import hardware

    return "vllm" if hardware()["gpus"] else "hf"


def run(recipe: Recipe, src: Path, out: Path, artifact: str = "baseline", method: str = "none",
        baseline_model: Path | None = None, baseline_eval: Path | None = None, backend: str | None = None) -> dict:
    """Evaluate the model in `src` (lm-eval, validation set, fidelity vs the baseline) into `out`."""
    ev = recipe.evaluation
    if ev.lm_eval is None and ev.validation is None:
        raise StageError("evaluation has neither `lm_eval` nor `validation`; add one of them or drop the evaluate stage")
    backend = backend or lm_eval_backend(recipe)
    if backend == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("lm_eval") is None:
            raise StageError(
                "evaluation.lm_eval.backend: vllm needs vLLM and lm-eval in one environment, and this one lacks "
                f"{'vLLM' if importlib.util.find_spec('vllm') is None else 'lm-eval'} ({sys.executable}); quantpipe runs "
                "the stage in the serve environment (scripts/setup_envs.sh serve), or use backend: hf"
            )
    if ev.lm_eval is not None:
        _import_lm_eval()
    src, out = Path(src), Path(out)
    is_artifact = artifact != "baseline"
    if is_artifact and (baseline_model is None or baseline_eval is None):
        raise StageError(f"artifact {artifact!r} needs baseline_model and baseline_eval to compare against (the runner passes both)")
    rows = load_validation(ev.validation.path, ev.validation.metric, ev.validation.json_schema) if ev.validation else None

    import torch

    torch.manual_seed(ev.lm_eval.seed if ev.lm_eval else 0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = _tokenizer(src, recipe)
    settings = _settings(recipe, tok, device, backend)
    timings = {}

    base = None
    if is_artifact:
        base = _read_baseline(Path(baseline_eval), settings)

    per_example: dict[str, list[float]] = {}
    ids: dict[str, list[str]] = {}
    higher: dict[str, bool] = {}
    lm_metrics = validation = fidelity = None
    extra: dict[str, Any] = {"versions": _versions(backend)}
    if backend == "vllm":  # one engine for lm-eval, the validation set and the fidelity logprobs
        lm_metrics, validation, fidelity = _run_vllm(recipe, src, out, artifact, method, tok, rows, settings, baseline_eval,
                                                     per_example, ids, higher, timings, extra)
    else:
        if ev.lm_eval:
            t0 = time.perf_counter()
            lm_metrics = _lm_eval(recipe, src, out, settings, per_example, ids, higher)
            timings["lm_eval_s"] = round(time.perf_counter() - t0, 2)
            _free()  # lm-eval's model copy, before the next one loads
            log.info("%s: lm-eval %s in %.1fs", artifact, json.dumps(lm_metrics), timings["lm_eval_s"])
        if rows is not None:
            model = _load_model(src, recipe, device)
            t0 = time.perf_counter()
            texts = _generate_hf(model, tok, rows, ev.validation, settings)
            validation = _score_validation(rows, texts, ev.validation, out, per_example, ids)
            timings["validation_s"] = round(time.perf_counter() - t0, 2)
            if is_artifact:
                t0 = time.perf_counter()
                ref_model = _load_model(Path(baseline_model), recipe, device)
                fidelity = _fidelity(ref_model, model, tok, rows, settings)
                timings["fidelity_s"] = round(time.perf_counter() - t0, 2)
                del ref_model
                log.info("%s: fidelity vs baseline %s", artifact, json.dumps(fidelity))
            del model
            _free()
            log.info("%s: validation %s", artifact, json.dumps(validation))

    comparison = None
    if is_artifact:
        comparison = _compare_all(base, per_example, ids, higher, lm_metrics, validation, ev.bootstrap_samples)

    (out / "per_example.json").write_text(json.dumps({"scores": per_example, "ids": ids, "higher_is_better": higher}))
    metrics = {
        "artifact": artifact, "method": method, "settings": settings, "lm_eval": lm_metrics,
        "validation": validation, "fidelity": fidelity, "comparison": comparison, "timings": timings, **extra,
    }
    (out / "evaluation.json").write_text(json.dumps(metrics, indent=2))
    return metrics


def _free() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _tokenizer(src: Path, recipe: Recipe):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(src), trust_remote_code=recipe.base.trust_remote_code)
    except (OSError, ValueError) as e:
        raise StageError(f"{src}: no usable tokenizer ({str(e)[:200]}); the model directory must hold its tokenizer files") from None


def _settings(recipe: Recipe, tok, device: str, backend: str = "hf") -> dict:
    """Everything that must be identical between the baseline and an artifact, recorded."""
    ev = recipe.evaluation
    le = ev.lm_eval
    bos = tok.bos_token_id
    probe = tok(PROBE)["input_ids"]
    tokenizer_adds_bos = bos is not None and len(probe) > 0 and probe[0] == bos
    add_bos = tokenizer_adds_bos if ev.add_bos is None else ev.add_bos
    if ev.add_bos and not tokenizer_adds_bos:
        # lm-eval's add_bos_token only toggles the tokenizer's special tokens: it cannot add a BOS the tokenizer never adds
        raise StageError(
            "evaluation.add_bos is true but this tokenizer does not add a BOS token itself (lm-eval cannot force one); "
            "remove add_bos, or set it to false"
        )
    chat = getattr(tok, "chat_template", None)
    s = {
        "backend": backend, "backend_requested": le.backend if le else None, "device": device,
        "tasks": list(le.tasks) if le else [], "num_fewshot": le.num_fewshot if le else None,
        "limit": le.limit if le else None, "batch_size": le.batch_size if le else None,
        "apply_chat_template": le.apply_chat_template if le else False,
        "fewshot_as_multiturn": bool(le and le.apply_chat_template), "seed": le.seed if le else None,
        "include_path": le.include_path if le else None, "dtype": recipe.base.dtype, "add_bos": add_bos,
        "add_bos_source": "tokenizer" if ev.add_bos is None else "recipe", "tokenizer_adds_bos": tokenizer_adds_bos,
        "tokenizer": {
            "bos_token": tok.bos_token, "eos_token": tok.eos_token, "pad_token": tok.pad_token,
            "probe_ids_sha256": hashlib.sha256(json.dumps(probe).encode()).hexdigest()[:16],
            "chat_template_sha256": hashlib.sha256(chat.encode()).hexdigest()[:16] if isinstance(chat, str) else None,
        },
        "validation": None, "bootstrap_samples": ev.bootstrap_samples, "bootstrap_seed": BOOTSTRAP_SEED,
    }
    if ev.validation:
        v = ev.validation
        s["validation"] = {"metric": v.metric, "max_new_tokens": v.max_new_tokens, "stop": list(v.stop), "decoding": "greedy", "batch_size": le.batch_size if le else 8, "padding": "left", "json_schema": v.json_schema,
                           "fidelity_reference": "prompt + (' ' if neither side has whitespace at the join) + reference; loss on reference tokens"}
        if backend == "vllm":  # one generate call, vLLM schedules the batches; KL from prompt logprobs (see _fidelity_topk)
            s["validation"].update(batch_size=None, padding=None, fidelity_kl=f"baseline top-{VLLM_LOGPROBS} tokens + one bucket for the rest")
    return s


def _read_baseline(baseline_eval: Path, settings: dict) -> dict:
    try:
        base = json.loads((baseline_eval / "evaluation.json").read_text())
        pe = json.loads((baseline_eval / "per_example.json").read_text())
    except (OSError, ValueError) as e:
        raise StageError(f"baseline_eval {baseline_eval}: no readable baseline evaluation ({e}); re-run the evaluate:baseline stage") from None
    diff = _differences(base.get("settings", {}), settings)
    if diff:
        detail = "; ".join(f"{k}: baseline {b!r}, artifact {a!r}" for k, b, a in diff)
        hint = (
            "the artifact's tokenizer differs from the baseline's (quantize from the same merged model, which copies its tokenizer files)"
            if any(k.startswith("tokenizer.") or k == "add_bos" for k, _, _ in diff)
            else "re-run the baseline with the same recipe (--force evaluate)"
        )
        raise StageError(f"the artifact would be evaluated with other settings than the baseline ({detail}); a fair comparison needs them equal: {hint}")
    return {**base, "per_example": pe}


def _differences(a: dict, b: dict, prefix: str = "") -> list[tuple[str, Any, Any]]:
    out = []
    for k in sorted(set(a) | set(b)):
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) and isinstance(y, dict):
            out += _differences(x, y, f"{prefix}{k}.")
        elif x != y:
            out.append((f"{prefix}{k}", x, y))
    return out


def _lm_eval(recipe: Recipe, src: Path, out: Path, settings: dict, per_example: dict, ids: dict, higher: dict,
             lm=None, model_args: dict | None = None) -> dict:
    """Run lm-eval's simple_evaluate as its CLI does, and keep the files its CLI would write.

    `lm`: lm-eval's vllm model, built by the caller from `model_args` as simple_evaluate would build it
    (so the caller can reuse its engine); None: the hf model, built here."""
    le = recipe.evaluation.lm_eval
    import shutil

    from lm_eval import simple_evaluate
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager

    if model_args is None:
        model_args = {"pretrained": str(src), "dtype": settings["dtype"], "add_bos_token": settings["add_bos"]}
        if recipe.base.trust_remote_code:
            model_args["trust_remote_code"] = True
    tm = TaskManager(include_path=le.include_path, metadata=dict(model_args))
    unknown = [t for t in le.tasks if t not in tm.all_tasks]
    if unknown:
        import difflib

        hints = [f"{t!r} (did you mean {', '.join(repr(m) for m in difflib.get_close_matches(t, tm.all_tasks, 3))}?)" if difflib.get_close_matches(t, tm.all_tasks, 3) else repr(t) for t in unknown]
        raise StageError(
            f"evaluation.lm_eval.tasks: unknown task {', '.join(hints)}; offline, tasks come from YAML files in "
            f"evaluation.lm_eval.include_path ({le.include_path or 'not set'})"
        )
    seed = le.seed
    tracker_dir = out / ".lm_eval"
    tracker = EvaluationTracker(output_path=str(tracker_dir))
    results = simple_evaluate(
        model="hf" if lm is None else lm, model_args=model_args, tasks=list(le.tasks), num_fewshot=le.num_fewshot,
        batch_size=le.batch_size, device=settings["device"], limit=le.limit, log_samples=True, evaluation_tracker=tracker,
        apply_chat_template=le.apply_chat_template, fewshot_as_multiturn=settings["fewshot_as_multiturn"], task_manager=tm,
        random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
    )
    samples = results.pop("samples", {})
    metrics: dict[str, dict] = {}
    for task, res in results["results"].items():
        m = {}
        for key, value in res.items():
            if "," not in key:
                continue  # name, alias, sample_len
            name, filt = key.split(",", 1)
            m[name if filt == "none" else f"{name},{filt}"] = value
        metrics[task] = m
    for task, rows in samples.items():
        hib = results.get("higher_is_better", {}).get(task, {})
        rows = sorted(rows, key=lambda r: r["doc_id"])
        for r in rows:
            filt = r.get("filter", "none")
            for name in r.get("metrics", []):
                v = r.get(name)
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    continue  # corpus-level metrics (bleu, perplexity) keep per-sample tuples: no paired bootstrap
                key = f"{task}/{name if filt == 'none' else f'{name},{filt}'}"
                per_example.setdefault(key, []).append(float(v))
                higher[key] = bool(hib.get(name, True))
        first = rows[0].get("filter", "none") if rows else "none"
        ids[task] = [f"{r['doc_id']}:{r.get('doc_hash', '')}" for r in rows if r.get("filter", "none") == first]
    # lm-eval's own writers (what `lm_eval --output_path --log_samples` writes), then stable names
    tracker.save_results_aggregated(results=results, samples=samples)
    for task in results["configs"]:
        tracker.save_results_samples(task_name=task, samples=samples[task])
    written = sorted(tracker_dir.rglob("results_*.json"))
    if len(written) != 1:
        raise RuntimeError(f"lm-eval wrote {len(written)} results files under {tracker_dir}, expected 1")
    os.replace(written[0], out / "lm_eval_results.json")
    sdir = out / "lm_eval_samples"
    sdir.mkdir(exist_ok=True)
    for task in results["configs"]:
        os.replace(written[0].parent / f"samples_{task}_{tracker.date_id}.jsonl", sdir / f"{task}.jsonl")
    shutil.rmtree(tracker_dir)
    return metrics


def _load_model(path: Path, recipe: Recipe, device: str):
    import torch
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=getattr(torch, recipe.base.dtype), trust_remote_code=recipe.base.trust_remote_code
        )
    except (OSError, ValueError) as e:
        raise StageError(f"{path}: cannot load the model with transformers ({str(e)[:300]})") from None
    return model.to(device).eval()


def _encode_prompt(tok, row: dict, add_bos: bool) -> list[int]:
    """Prompt ids: raw text with the tokenizer's own BOS rule; chat `messages` through the chat template, never a double BOS."""
    if "messages" in row:
        if not getattr(tok, "chat_template", None):
            raise StageError(f"{row['_where']}: the row has chat `messages` but the tokenizer has no chat template; give a `prompt` instead")
        text = tok.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)
    else:
        text = row["prompt"]
    starts_with_bos = tok.bos_token is not None and text.startswith(tok.bos_token)
    return tok(text, add_special_tokens=add_bos and not starts_with_bos)["input_ids"]


def _row_id(row: dict) -> str:
    key = {k: row.get(k) for k in ("prompt", "messages", "reference", "metric")}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _generate_hf(model, tok, rows: list[dict], cfg, settings: dict) -> list[str]:
    """Greedy generation with transformers (left-padded batches, longest prompts first); outputs cut at the stop strings."""
    import torch

    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    prompts = [_encode_prompt(tok, row, settings["add_bos"]) for row in rows]
    order = sorted(range(len(rows)), key=lambda i: (-len(prompts[i]), i))
    bs = settings["validation"]["batch_size"]
    texts: list[str] = [""] * len(rows)
    with torch.inference_mode():
        for start in range(0, len(order), bs):
            batch = order[start:start + bs]
            width = max(len(prompts[i]) for i in batch)
            x = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in batch], device=model.device)
            mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in batch], device=model.device)
            gen = model.generate(
                x, attention_mask=mask, max_new_tokens=cfg.max_new_tokens, do_sample=False,
                temperature=None, top_p=None, top_k=None, pad_token_id=pad,
            )
            for j, i in enumerate(batch):
                texts[i] = _output_text(tok, gen[j, width:], cfg.stop)
    return texts


def _output_text(tok, token_ids, stop: list[str]) -> str:
    text = tok.decode(token_ids, skip_special_tokens=True)
    for s in stop:
        text = text.split(s, 1)[0]
    return text


def _score_validation(rows: list[dict], texts: list[str], cfg, out: Path, per_example: dict, ids: dict) -> dict:
    """Each output scored by its row's metric; the outputs written to validation_outputs.jsonl."""
    scores, by_metric = [], {}
    with open(out / "validation_outputs.jsonl", "w") as f:
        for row, text in zip(rows, texts):
            score = score_output(text, row)
            scores.append(score)
            by_metric.setdefault(row["metric"], []).append(score)
            f.write(json.dumps({"line": row["_line"], "metric": row["metric"], "reference": row.get("reference"), "output": text, "score": score}, ensure_ascii=False) + "\n")
    metric = cfg.metric if set(by_metric) == {cfg.metric} else "mixed"
    per_example[f"validation/{metric}"] = scores
    ids["validation"] = [_row_id(r) for r in rows]
    result = {"metric": metric, "score": sum(scores) / len(scores), "n": len(scores)}
    if metric == "mixed":
        result["by_metric"] = {m: {"score": sum(v) / len(v), "n": len(v)} for m, v in sorted(by_metric.items())}
    return result


def _fidelity(ref_model, model, tok, rows: list[dict], settings: dict) -> dict | None:
    """KL(baseline || artifact), top-1 agreement and perplexity over the reference tokens of each row."""
    import torch

    kl_sum = agree = n = 0
    nll_a = nll_b = 0.0
    with torch.inference_mode():
        for row in rows:
            if not row.get("reference"):
                continue
            p = _encode_prompt(tok, row, settings["add_bos"])
            r = tok(_continuation(row), add_special_tokens=False)["input_ids"]
            if not r:
                continue
            x = torch.tensor([p + r], device=model.device)
            sl = slice(len(p) - 1, len(p) + len(r) - 1)  # positions that predict the reference tokens
            lb = torch.log_softmax(ref_model(x).logits[0, sl].float(), dim=-1)
            la = torch.log_softmax(model(x).logits[0, sl].float(), dim=-1)
            target = torch.tensor(r, device=model.device)
            kl_sum += float((lb.exp() * (lb - la)).sum(dim=-1).clamp_min(0).sum())
            agree += int((lb.argmax(-1) == la.argmax(-1)).sum())
            nll_b -= float(lb.gather(1, target[:, None]).sum())
            nll_a -= float(la.gather(1, target[:, None]).sum())
            n += len(r)
    if n == 0:
        return None
    return {"kl_mean": kl_sum / n, "top1_agreement": agree / n, "ppl": math.exp(nll_a / n), "ppl_baseline": math.exp(nll_b / n), "n_tokens": n,
            "kl_support": "full vocabulary"}


# --- the vllm backend: one engine for lm-eval, the validation set and the fidelity logprobs ------


def _run_vllm(recipe: Recipe, src: Path, out: Path, artifact: str, method: str, tok, rows: list[dict] | None, settings: dict,
              baseline_eval: Path | None, per_example: dict, ids: dict, higher: dict, timings: dict, extra: dict):
    """lm-eval with its vllm model, then greedy validation and prompt logprobs through that model's engine."""
    ev = recipe.evaluation
    t0 = time.perf_counter()
    lm, model_args, engine = _vllm_model(recipe, src, artifact, method, settings)
    timings["engine_start_s"] = round(time.perf_counter() - t0, 2)
    extra["engine"] = engine
    extra["lm_eval_command"] = _lm_eval_command(recipe, model_args)
    t0 = time.perf_counter()
    lm_metrics = _lm_eval(recipe, src, out, settings, per_example, ids, higher, lm=lm, model_args=model_args)
    timings["lm_eval_s"] = round(time.perf_counter() - t0, 2)
    log.info("%s: lm-eval %s in %.1fs", artifact, json.dumps(lm_metrics), timings["lm_eval_s"])
    validation = fidelity = None
    if rows is not None:
        from vllm import SamplingParams, TokensPrompt

        t0 = time.perf_counter()
        prompts = [TokensPrompt(prompt_token_ids=_encode_prompt(tok, row, settings["add_bos"])) for row in rows]
        outs = lm.model.generate(prompts, SamplingParams(temperature=0.0, max_tokens=ev.validation.max_new_tokens), use_tqdm=False)
        texts = [_output_text(tok, o.outputs[0].token_ids, ev.validation.stop) for o in outs]
        validation = _score_validation(rows, texts, ev.validation, out, per_example, ids)
        timings["validation_s"] = round(time.perf_counter() - t0, 2)
        log.info("%s: validation %s", artifact, json.dumps(validation))
        t0 = time.perf_counter()
        mine = _reference_logprobs(lm.model, tok, rows, settings)
        if baseline_eval is None:  # the baseline keeps its logprobs for the artifacts' stages
            (out / "fidelity_reference.json").write_text(json.dumps({"logprobs": VLLM_LOGPROBS, "rows": mine}))
        else:
            try:
                ref = json.loads((Path(baseline_eval) / "fidelity_reference.json").read_text())
            except (OSError, ValueError) as e:
                raise StageError(f"baseline_eval {baseline_eval}: no readable fidelity_reference.json ({e}); re-run evaluate:baseline with backend vllm (--force evaluate)") from None
            fidelity = _fidelity_topk(ref["rows"], mine)
            log.info("%s: fidelity vs baseline %s", artifact, json.dumps(fidelity))
        timings["fidelity_s"] = round(time.perf_counter() - t0, 2)
    return lm_metrics, validation, fidelity


def _vllm_model(recipe: Recipe, src: Path, artifact: str, method: str, settings: dict):
    """lm-eval's vllm model, built as `lm_eval --model vllm --model_args ...` builds it (this starts the engine).

    Refused before any engine starts when vLLM has no kernel for the checkpoint's scheme on this machine."""
    # What vLLM can run here and the CPU KV-cache size, as the benchmark stage decides them. (Not in this
    # stage's cache key: they decide a refusal, never cached, and a KV-cache size, which moves no figure.)
    from .benchmark import DEFAULT_CPU_KV_BYTES, _model_config, kv_bytes_per_token, probe_platform, quant_scheme, unservable_reason

    plat = probe_platform()
    scheme = quant_scheme(src)
    reason = unservable_reason(scheme, method, plat)
    if reason:
        raise StageError(
            f"{artifact}: evaluation.lm_eval.backend vllm cannot evaluate it on this machine: {reason}. "
            "Set evaluation.lm_eval.backend: hf (transformers reads every scheme), or evaluate on a machine whose vLLM serves it"
        )
    le = recipe.evaluation.lm_eval
    model_args = {"pretrained": str(src), "dtype": settings["dtype"], "add_bos_token": settings["add_bos"], "seed": le.seed}
    if recipe.base.trust_remote_code:
        model_args["trust_remote_code"] = True
    if plat["platform"] == "cpu":
        if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            # vLLM's CPU worker needs an explicit KV-cache size: room for one sequence of the model's full length
            bpt = (kv_bytes_per_token(src, None) or 0) * (2 if settings["dtype"] == "float32" else 1)
            need = bpt * (_model_config(src).get("max_position_embeddings") or 0)
            model_args["kv_cache_memory_bytes"] = max(DEFAULT_CPU_KV_BYTES, math.ceil(need / 2**20) * 2**20)
    if le.gpu_memory_utilization is not None and plat["platform"] != "cpu":
        model_args["gpu_memory_utilization"] = le.gpu_memory_utilization
    # Evaluation measures accuracy, not speed: torch.compile and CUDA-graph capture would only lengthen the
    # engine start (on the CPU 35-110 s on 2 cores; on an H200 ~45 s of a ~90 s start for an 8B model), and a
    # separate engine-core process costs one more import of vLLM (~20 s there) and a hop per request. So the
    # engine runs eager and in-process, on every platform; lm_eval_command records both.
    model_args["enforce_eager"] = True
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from lm_eval.models.vllm_causallms import VLLM

    lm = VLLM.create_from_arg_obj(model_args, {"batch_size": le.batch_size, "device": settings["device"]})
    env = {k: os.environ[k] for k in VLLM_ENV if k in os.environ}
    engine = {"model_args": {k: v for k, v in model_args.items() if k != "pretrained"}, "env": env, "platform": plat, "scheme": scheme}
    return lm, model_args, engine


def _lm_eval_command(recipe: Recipe, model_args: dict) -> str:
    """The `lm_eval` command line (with the vLLM environment variables set) that gives the same lm-eval figures."""
    le = recipe.evaluation.lm_eval
    cmd = [f"{k}={os.environ[k]}" for k in VLLM_ENV if k in os.environ]
    cmd += ["lm_eval", "--model", "vllm", "--model_args", ",".join(f"{k}={v}" for k, v in model_args.items()),
           "--tasks", ",".join(le.tasks), "--batch_size", str(le.batch_size), "--seed", str(le.seed)]
    if le.num_fewshot is not None:
        cmd += ["--num_fewshot", str(le.num_fewshot)]
    if le.limit is not None:
        cmd += ["--limit", str(le.limit)]
    if le.include_path:
        cmd += ["--include_path", le.include_path]
    if le.apply_chat_template:
        cmd += ["--apply_chat_template", "--fewshot_as_multiturn"]
    return " ".join(cmd)


def _reference_logprobs(llm, tok, rows: list[dict], settings: dict) -> list[list[dict] | None]:
    """Per row (None without a reference), per reference token: its id and logprob, and the top logprobs of its position."""
    from vllm import SamplingParams, TokensPrompt

    todo = []
    for i, row in enumerate(rows):
        if not row.get("reference"):
            continue
        p = _encode_prompt(tok, row, settings["add_bos"])
        r = tok(_continuation(row), add_special_tokens=False)["input_ids"]
        if r:
            todo.append((i, p, r))
    result: list[list[dict] | None] = [None] * len(rows)
    if not todo:
        return result
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=VLLM_LOGPROBS, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p + r) for _, p, r in todo], params, use_tqdm=False)
    for (i, p, r), o in zip(todo, outs):
        positions = []
        for j, target in enumerate(r):
            d = o.prompt_logprobs[len(p) + j]  # the position that predicts reference token j
            top = sorted(((int(t), float(lp.logprob)) for t, lp in d.items() if lp.rank is not None and lp.rank <= VLLM_LOGPROBS), key=lambda x: -x[1])
            positions.append({"target": int(target), "target_logprob": float(d[target].logprob), "top": top})
        result[i] = positions
    return result


def kl_topk(p: dict[int, float], q: dict[int, float]) -> float:
    """KL(P || Q) of two next-token distributions known by the logprobs of some tokens each.

    Tokens known on both sides count one by one, every other token goes into one `rest` bucket. Merging
    tokens never raises KL (log-sum inequality), so this is a lower bound of the full-vocabulary KL, and
    exact when the tokens known on both sides hold all the probability. The rest bucket of Q is floored
    at 1e-6 (float32 logprobs sum to 1 within about that), which keeps the bound a lower bound."""
    shared = p.keys() & q.keys()
    kl = math.fsum(math.exp(p[t]) * (p[t] - q[t]) for t in shared)
    p_rest = 1.0 - math.fsum(math.exp(p[t]) for t in shared)
    q_rest = 1.0 - math.fsum(math.exp(q[t]) for t in shared)
    if p_rest > 0 and p_rest != q_rest:
        kl += p_rest * (math.log(p_rest) - math.log(max(q_rest, 1e-6)))
    return max(kl, 0.0)


def _fidelity_topk(base: list, mine: list) -> dict | None:
    """KL(baseline || artifact) (over each position's top logprobs, see kl_topk), top-1 agreement and perplexity
    of the reference tokens, from the vLLM prompt logprobs of both (top-1 and perplexity are exact)."""
    if len(base) != len(mine) or any((b is None) != (a is None) or (b and [x["target"] for x in b] != [x["target"] for x in a]) for b, a in zip(base, mine)):
        raise StageError("the baseline's fidelity logprobs are for other reference tokens than this artifact's; re-run evaluate:baseline (--force evaluate)")
    kl_sum = 0.0
    agree = n = 0
    nll_a = nll_b = 0.0
    for b_row, a_row in zip(base, mine):
        for b, a in zip(b_row or [], a_row or []):
            pb = {int(t): lp for t, lp in b["top"]} | {b["target"]: b["target_logprob"]}
            pa = {int(t): lp for t, lp in a["top"]} | {a["target"]: a["target_logprob"]}
            kl_sum += kl_topk(pb, pa)
            agree += int(b["top"][0][0] == a["top"][0][0])
            nll_b -= b["target_logprob"]
            nll_a -= a["target_logprob"]
            n += 1
    if n == 0:
        return None
    return {"kl_mean": kl_sum / n, "top1_agreement": agree / n, "ppl": math.exp(nll_a / n), "ppl_baseline": math.exp(nll_b / n), "n_tokens": n,
            "kl_support": f"top-{VLLM_LOGPROBS} logprobs per position + one bucket for the rest (a lower bound of the full KL)"}


def _import_lm_eval() -> None:
    """Import lm-eval's evaluator before any model or engine loads, so that a missing dependency fails the
    stage in seconds, not after a ~90 s engine start (on the H200 `datasets` was missing, 2026-11-30)."""
    try:
        import lm_eval.evaluator  # noqa: F401
    except ImportError as e:
        raise StageError(
            f"lm-eval cannot be imported in this stage's environment ({sys.executable}): {e}. Install what it names "
            "there (scripts/setup_envs.sh rebuilds the environments from their locks; on a GPU host add it to scripts/gpu/extra.txt)"
        ) from None


def _versions(backend: str) -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("lm_eval", "torch", "transformers", "compressed-tensors", *(("vllm",) if backend == "vllm" else ())):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def _continuation(row: dict) -> str:
    """The reference as the text that follows the prompt: a raw prompt and a reference that meet without
    whitespace get one space between them (lm-eval's default target_delimiter), so "2 plus 2 is" + "4"
    is scored as " 4", the continuation the model would write. Chat prompts end in the template's own
    generation prompt and take the reference as it is."""
    ref = row["reference"]
    if "prompt" in row and not row["prompt"][-1:].isspace() and not ref[:1].isspace():
        return " " + ref
    return ref


def _compare_all(base: dict, per_example: dict, ids: dict, higher: dict, lm_metrics: dict | None, validation: dict | None, samples: int) -> list[dict]:
    """Paired comparison per task and metric (per-example where scores are per-example means, else aggregate only)."""
    bpe = base["per_example"]
    for task, mine in ids.items():
        theirs = bpe.get("ids", {}).get(task)
        if theirs != mine:
            raise StageError(
                f"{task}: the baseline was scored on different examples ({len(theirs or [])} vs {len(mine)}, or other documents); "
                "re-run evaluate:baseline with the same data (--force evaluate)"
            )
    rows = []
    for task, m in (lm_metrics or {}).items():
        for name, value in m.items():
            if "_stderr" in name or not isinstance(value, (int, float)):
                continue
            key = f"{task}/{name}"
            bval = (base.get("lm_eval") or {}).get(task, {}).get(name)
            if key in per_example and key in bpe["scores"] and _is_mean(per_example[key], value) and _is_mean(bpe["scores"][key], bval):
                c = compare(bpe["scores"][key], per_example[key], samples, higher.get(key, True))
            else:
                hib = higher.get(key, True)
                num, den = (value, bval) if hib else (bval, value)
                c = {"baseline": bval, "artifact": value, "recovery": (num / den if bval is not None and den else None), "ci95": None, "flip_rate": None, "n": None}
            rows.append({"task": task, "metric": name, **c})
    if validation is not None:
        key = f"validation/{validation['metric']}"
        if key not in bpe["scores"]:
            raise StageError("the baseline has no validation scores for this metric; re-run evaluate:baseline (--force evaluate)")
        rows.append({"task": "validation", "metric": validation["metric"], **compare(bpe["scores"][key], per_example[key], samples, True)})
    return rows


def _is_mean(scores: list[float] | None, value) -> bool:
    return bool(scores) and value is not None and abs(sum(scores) / len(scores) - value) <= 1e-9 * max(1.0, abs(value))
