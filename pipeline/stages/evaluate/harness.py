"""lm-eval through its Python API, as its CLI runs it: the same figures, the same files, per-example scores kept. Both
backends call `run_lm_eval`: hf lets lm-eval build its hf model from `model_args`; vllm passes the model it built (so
the same engine then serves the validation set).

    metrics = run_lm_eval(lm_eval_cfg, model_args, out, settings, scores)   # {"task": {"acc": 0.5, ...}}
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .. import StageError
from .compare import Scores


def import_lm_eval() -> None:
    """Import lm-eval before any model or engine loads, so a missing dependency fails in seconds, not after an engine start."""
    try:
        import lm_eval.evaluator  # noqa: F401
    except ImportError as e:
        raise StageError(
            f"lm-eval cannot be imported in this stage's environment ({sys.executable}): {e}. Install what it names "
            "there (scripts/setup_envs.sh rebuilds the environments from their locks)"
        ) from None


def hf_model_args(src: Path, settings: dict, trust_remote_code: bool) -> dict:
    """`--model_args` of lm-eval's hf model for the model in `src`."""
    model_args = {"pretrained": str(src), "dtype": settings["dtype"], "add_bos_token": settings["add_bos"]}
    if trust_remote_code:
        model_args["trust_remote_code"] = True
    return model_args


def run_lm_eval(le, model_args: dict, out: Path, settings: dict, scores: Scores, lm=None) -> dict:
    """Run lm-eval's simple_evaluate as its CLI does, and keep the files its CLI would write. `lm`: a model the caller
    built from `model_args` as simple_evaluate would (so it can reuse its engine); None: lm-eval builds its hf model."""
    import shutil

    from ...lm_tasks import code_problems

    refused = code_problems(le)  # as `check` refuses them: a recipe that reached the stage another way is refused too
    if refused:
        raise StageError(refused[0])

    from lm_eval import simple_evaluate
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=le.include_path, metadata=dict(model_args))
    unknown = [t for t in le.tasks if t not in tm.all_tasks]
    if unknown:
        import difflib

        hints = [
            f"{t!r} (did you mean {', '.join(repr(m) for m in difflib.get_close_matches(t, tm.all_tasks, 3))}?)"
            if difflib.get_close_matches(t, tm.all_tasks, 3)
            else repr(t)
            for t in unknown
        ]
        raise StageError(
            f"evaluation.lm_eval.tasks: unknown task {', '.join(hints)}; offline, tasks come from YAML files in "
            f"evaluation.lm_eval.include_path ({le.include_path or 'not set'})"
        )
    seed = le.seed
    tracker_dir = out / ".lm_eval"
    tracker = EvaluationTracker(output_path=str(tracker_dir))
    results = simple_evaluate(
        model="hf" if lm is None else lm,
        model_args=model_args,
        tasks=list(le.tasks),
        num_fewshot=le.num_fewshot,
        batch_size=le.batch_size,
        device=settings["device"],
        limit=le.limit,
        log_samples=True,
        evaluation_tracker=tracker,
        apply_chat_template=le.apply_chat_template,
        fewshot_as_multiturn=settings["fewshot_as_multiturn"],
        task_manager=tm,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
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
                scores.per_example.setdefault(key, []).append(float(v))
                scores.higher[key] = bool(hib.get(name, True))
        first = rows[0].get("filter", "none") if rows else "none"
        scores.ids[task] = [f"{r['doc_id']}:{r.get('doc_hash', '')}" for r in rows if r.get("filter", "none") == first]
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
