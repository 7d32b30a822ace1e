"""Evaluate stage: score the baseline and every artifact through one path, and compare them.

The baseline and each artifact get the same lm-eval tasks (`simple_evaluate`), the user's validation set
(greedy, scored per row) and, for artifacts, token-level fidelity against the baseline (fidelity.py), each
figure with a 95% interval; an artifact's stage pairs its per-example scores with the baseline's (recovery
with a paired bootstrap CI, flip rate). The backend is hf (hf.py) or vllm (vllm.py), as docs/architecture.md
describes; an artifact whose tokenizer, BOS rule, chat template, backend or settings differ from the
baseline's is refused rather than compared. Output files: docs/outputs.md.

    quantpipe run recipes/demo.yaml --stages evaluate
"""

from __future__ import annotations

import hashlib
import json
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...common.compute import compute_dtype
from .. import StageError
from .compare import BOOTSTRAP_SEED, Scores, compare, compare_all
from .fidelity import load_documents
from .fidelity import settings as fidelity_settings
from .harness import import_lm_eval
from .validation import METRICS, load_validation, schema_errors, score_output
from .vllm import VLLM_LOGPROBS, kl_topk

if TYPE_CHECKING:
    from ..contract import EvaluateInput, Upstream

__all__ = [
    "run",
    "load_validation",
    "load_documents",
    "score_output",
    "schema_errors",
    "compare",
    "kl_topk",
    "METRICS",
    "BOOTSTRAP_SEED",
    "VLLM_LOGPROBS",
]

PROBE = "Hello world! 12 + 30 = 42.\nThe end."  # tokenized by baseline and artifact: must give the same ids


def run(inp: EvaluateInput, src: Path, out: Path, upstream: dict[str, Upstream], server=None) -> dict:
    """Evaluate the model in `src` (lm-eval, validation set, fidelity vs the baseline) into `out`.

    An artifact's stage reads `upstream["baseline_model"].out` (the merged model) and
    `upstream["baseline_eval"].out` (the baseline's evaluate output); the baseline's gets {}. `server`: a
    quantpipe.server.Server already serving `src` (the benchmark's, in a joint job) for backend vllm."""
    if inp.lm_eval is None and inp.validation is None and inp.fidelity is None:
        raise StageError(
            "evaluation has none of `lm_eval`, `validation` and `fidelity`; add one of them or drop the evaluate stage"
        )
    is_artifact = inp.artifact != "baseline"
    baseline_model = baseline_eval = None
    if is_artifact:
        missing = [role for role in ("baseline_model", "baseline_eval") if role not in upstream]
        if missing:
            raise StageError(
                f"artifact {inp.artifact!r} needs upstream {' and '.join(missing)} to compare against (the runner passes both)"
            )
        baseline_model, baseline_eval = Path(upstream["baseline_model"].out), Path(upstream["baseline_eval"].out)
    if inp.backend == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("lm_eval") is None:
            raise StageError(
                "evaluation.lm_eval.backend: vllm needs vLLM and lm-eval in one environment, and this one lacks "
                f"{'vLLM' if importlib.util.find_spec('vllm') is None else 'lm-eval'} ({sys.executable}); quantpipe runs "
                "the stage in the serve environment (scripts/setup_envs.sh serve), or use backend: hf"
            )
    if inp.lm_eval is not None:
        import_lm_eval()
        if inp.backend == "vllm":
            import importlib.util

            missing = [m for m in ("aiohttp", "tenacity", "requests") if importlib.util.find_spec(m) is None]
            if missing:
                raise StageError(
                    f"evaluation.lm_eval.backend: vllm evaluates through lm-eval's local-completions model, which needs "
                    f"{', '.join(missing)} (lm-eval[api]) in {sys.executable}; rebuild the serve environment from its lock "
                    "(scripts/setup_envs.sh serve)"
                )
    src, out = Path(src), Path(out)
    v = inp.validation
    rows = load_validation(v.path, v.metric, v.json_schema) if v else None
    if inp.fidelity is not None:
        load_documents(inp.fidelity.path)  # a bad line fails here, before any model loads

    import torch

    torch.manual_seed(inp.lm_eval.seed if inp.lm_eval else 0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = _tokenizer(src, inp.base.trust_remote_code)
    settings = _settings(inp, tok, device)
    timings: dict[str, float] = {}
    base = _read_baseline(baseline_eval, settings) if is_artifact else None

    scores = Scores()
    extra: dict[str, Any] = {"versions": _versions(inp.backend)}
    if inp.backend == "vllm":  # one server for lm-eval, the validation set and the fidelity logprobs
        from .vllm import run_vllm

        lm_metrics, validation, fidelity = run_vllm(
            inp, src, out, tok, rows, settings, baseline_eval, scores, timings, extra, server
        )
    else:
        from .hf import run_hf

        lm_metrics, validation, fidelity = run_hf(
            inp, src, out, tok, rows, settings, baseline_model, baseline_eval, scores, timings
        )

    comparison = compare_all(base, scores, lm_metrics, validation, inp.bootstrap_samples) if is_artifact else None
    (out / "per_example.json").write_text(json.dumps(scores.to_json()))
    metrics = {
        "artifact": inp.artifact,
        "method": inp.method,
        "settings": settings,
        "lm_eval": lm_metrics,
        "validation": validation,
        "fidelity": fidelity,
        "comparison": comparison,
        "timings": timings,
        **extra,
    }
    (out / "evaluation.json").write_text(json.dumps(metrics, indent=2))
    return metrics


def _tokenizer(src: Path, trust_remote_code: bool):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(src), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise StageError(
            f"{src}: no usable tokenizer ({str(e)[:200]}); the model directory must hold its tokenizer files"
        ) from None


def _settings(inp: EvaluateInput, tok, device: str) -> dict:
    """Everything that must be identical between the baseline and an artifact, recorded."""
    le = inp.lm_eval
    bos = tok.bos_token_id
    probe = tok(PROBE)["input_ids"]
    tokenizer_adds_bos = bos is not None and len(probe) > 0 and probe[0] == bos
    add_bos = tokenizer_adds_bos if inp.add_bos is None else inp.add_bos
    if inp.add_bos and not tokenizer_adds_bos:
        # lm-eval's add_bos_token only toggles the tokenizer's special tokens: it cannot add a BOS the tokenizer never adds
        raise StageError(
            "evaluation.add_bos is true but this tokenizer does not add a BOS token itself (lm-eval cannot force one); "
            "remove add_bos, or set it to false"
        )
    chat = getattr(tok, "chat_template", None)
    s = {
        "backend": inp.backend,
        "backend_requested": le.backend if le else None,
        "device": device,
        "tasks": list(le.tasks) if le else [],
        "num_fewshot": le.num_fewshot if le else None,
        "limit": le.limit if le else None,
        "batch_size": le.batch_size if le else None,
        "apply_chat_template": le.apply_chat_template if le else False,
        "fewshot_as_multiturn": bool(le and le.apply_chat_template),
        "seed": le.seed if le else None,
        "include_path": le.include_path if le else None,
        "model_dtype": inp.base.dtype,
        # hf computes in float32 on a CPU without fast kernels for the model's half dtype (common/compute.py)
        "dtype": compute_dtype(inp.base.dtype, device) if inp.backend == "hf" else inp.base.dtype,
        "add_bos": add_bos,
        "add_bos_source": "tokenizer" if inp.add_bos is None else "recipe",
        "tokenizer_adds_bos": tokenizer_adds_bos,
        "tokenizer": {
            "bos_token": tok.bos_token,
            "eos_token": tok.eos_token,
            "pad_token": tok.pad_token,
            "probe_ids_sha256": hashlib.sha256(json.dumps(probe).encode()).hexdigest()[:16],
            "chat_template_sha256": hashlib.sha256(chat.encode()).hexdigest()[:16] if isinstance(chat, str) else None,
        },
        "validation": None,
        "bootstrap_samples": inp.bootstrap_samples,
        "bootstrap_seed": BOOTSTRAP_SEED,
        "fidelity": fidelity_settings(inp) if inp.fidelity or inp.validation else None,
    }
    if inp.validation:
        v = inp.validation
        s["validation"] = {
            "metric": v.metric,
            "max_new_tokens": v.max_new_tokens,
            "stop": list(v.stop),
            "decoding": "greedy",
            "batch_size": le.batch_size if le else 8,
            "padding": "left",
            "json_schema": v.json_schema,
            "fidelity_reference": "prompt + (' ' if neither side has whitespace at the join) + reference; loss on reference tokens",
        }
        if inp.backend == "vllm":  # one generate call, vLLM schedules the batches
            s["validation"].update(batch_size=None, padding=None)
    if s["fidelity"] and inp.backend == "vllm":  # KL from prompt logprobs (see vllm.fidelity_topk)
        s["fidelity"]["kl"] = f"baseline top-{VLLM_LOGPROBS} tokens + one bucket for the rest"
    return s


def _read_baseline(baseline_eval: Path, settings: dict) -> dict:
    """The baseline's evaluation.json with its per_example.json, refused when its settings differ from `settings`."""
    try:
        base = json.loads((baseline_eval / "evaluation.json").read_text())
        pe = json.loads((baseline_eval / "per_example.json").read_text())
    except (OSError, ValueError) as e:
        raise StageError(
            f"baseline_eval {baseline_eval}: no readable baseline evaluation ({e}); re-run the evaluate:baseline stage"
        ) from None
    diff = _differences(base.get("settings", {}), settings)
    if diff:
        detail = "; ".join(f"{k}: baseline {b!r}, artifact {a!r}" for k, b, a in diff)
        hint = (
            "the artifact's tokenizer differs from the baseline's (quantize from the same merged model, which copies its tokenizer files)"
            if any(k.startswith("tokenizer.") or k == "add_bos" for k, _, _ in diff)
            else "re-run the baseline with the same recipe (--force evaluate)"
        )
        raise StageError(
            f"the artifact would be evaluated with other settings than the baseline ({detail}); a fair comparison needs them equal: {hint}"
        )
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


def _versions(backend: str) -> dict[str, str | None]:
    out = {}
    for name in ("lm_eval", "torch", "transformers", "compressed-tensors", *(("vllm",) if backend == "vllm" else ())):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out
