"""Path fields are types in the recipe schema: resolving, file checks and the stage cache key find them by walking the
models, so a new path field takes part in all three by its type alone, and no module keeps a list of them (fast).

.venv/quantize/bin/python -m pytest tests/test_paths.py -q
"""

import importlib
import inspect
import re
from pathlib import Path

import pytest
import yaml

from quantpipe.cache import ContentHasher
from quantpipe.recipe import Recipe, Strict, load, parse, path_values
from quantpipe.recipe.paths import LocalFile, map_paths
from quantpipe.run import plan
from quantpipe.run.plan import Step, compute_keys, local_paths

REPO = Path(__file__).resolve().parents[1]
load_module = importlib.import_module("quantpipe.recipe.load")  # the package exports a function of the same name

FULL = {
    "name": "t",
    "output_dir": "out",
    "cache_dir": "cache",
    "base": {"model": "model"},
    "adapters": [{"path": "adapter"}],
    "calibration": {"sources": [{"path": "cal.jsonl"}, {"dataset": "org/data"}]},
    "artifacts": [{"name": "f", "method": "fp8"}, {"name": "g", "method": "gptq"}],
    "evaluation": {
        "lm_eval": {"tasks": ["t"], "include_path": "tasks"},
        "validation": {"path": "val.jsonl", "json_schema": "schema.json"},
        "fidelity": {"path": "heldout.jsonl"},
    },
}


def test_the_walker_finds_every_path_field_of_the_recipe(tmp_path):
    r = parse(yaml.safe_dump(FULL), tmp_path, check_files=False)
    found = {loc: (value, m.place) for loc, value, m in path_values(r)}
    assert list(found) == [
        "output_dir",
        "cache_dir",
        "base.model",
        "adapters.0.path",
        "calibration.sources.0.path",
        "evaluation.lm_eval.include_path",
        "evaluation.validation.path",
        "evaluation.validation.json_schema",
        "evaluation.fidelity.path",
    ]
    assert all(Path(v).is_absolute() and Path(v).parent == tmp_path.resolve() for v, _ in found.values())
    assert [loc for loc, (_, place) in found.items() if place] == ["output_dir", "cache_dir"]
    # inputs count by content in the key; places (output_dir, cache_dir) do not
    assert local_paths(r, "/base") == {"/base"} | {v for v, place in found.values() if not place}


def test_a_hub_id_is_left_as_it_is_and_not_hashed(tmp_path):
    r = parse(yaml.safe_dump({**FULL, "base": {"model": "org/model"}}), tmp_path, check_files=False)
    assert r.base.model == "org/model"
    assert "org/model" not in local_paths(r, "/base")
    local = parse(yaml.safe_dump({**FULL, "base": {"model": "./org/model"}}), tmp_path, check_files=False)
    assert local.base.model == str(tmp_path.resolve() / "org" / "model")


class _Extra(Strict):
    prompts: LocalFile
    label: str = "x"


class _RecipeWithExtra(Recipe):
    extra: _Extra


def test_a_new_path_field_is_resolved_checked_and_hashed_by_content(tmp_path):
    """A model no list knows: its LocalFile field is resolved against the recipe's folder, checked, and its file's
    content reaches the cache key of a stage that reads it."""
    data = {**FULL, "base": {"model": "org/model"}, "adapters": [], "calibration": None, "evaluation": {}}
    data["artifacts"] = [{"name": "f", "method": "fp8"}]
    data["extra"] = {"prompts": "prompts.txt"}
    resolved = map_paths(data, _RecipeWithExtra, lambda v, loc, m: v if m.hub_id else str(tmp_path / v))
    assert resolved["extra"]["prompts"] == str(tmp_path / "prompts.txt")
    assert resolved["extra"] != data["extra"] and data["extra"]["prompts"] == "prompts.txt"  # the input is left alone
    r = _RecipeWithExtra.model_validate(resolved)
    prompts = tmp_path / "prompts.txt"

    assert ("extra.prompts", str(prompts)) in [(loc, v) for loc, v, _ in path_values(r)]
    assert str(prompts) in local_paths(r, "/base")
    assert load_module._check_files(r) == [f"extra.prompts: {prompts} does not exist"]

    def key() -> str:
        step = Step("merge", "merge", None, "external", r.extra, env="quantize")
        compute_keys([step], r, "/base", ContentHasher(tmp_path / "memo.json"))
        return step.key

    prompts.write_text("one\n")
    assert load_module._check_files(r) == []
    first = key()
    assert key() == first
    prompts.write_text("another prompt\n")
    assert key() != first


def test_missing_files_are_named_by_their_field(tmp_path):
    with pytest.raises(load_module.RecipeError) as e:
        parse(yaml.safe_dump(FULL), tmp_path)
    msg = str(e.value)
    for line in [
        "base.model: {d}/model is not a directory; give a local model directory or a hub id (org/name)",
        "adapters.0.path: {d}/adapter is not a directory",
        "calibration.sources.0.path: {d}/cal.jsonl does not exist",
        "evaluation.lm_eval.include_path: {d}/tasks is not a directory",
        "evaluation.validation.path: {d}/val.jsonl does not exist",
        "evaluation.validation.json_schema: {d}/schema.json does not exist",
        'evaluation.fidelity.path: {d}/heldout.jsonl does not exist; point it at a JSONL file of held-out documents, one {{"text": ...}} per line',
    ]:
        assert f"  - {line.format(d=tmp_path.resolve())}" in msg, line
    assert "output_dir" not in msg and "cache_dir" not in msg


def test_no_module_lists_the_path_fields_by_hand():
    """Resolving, checking and hashing walk the schema: none of them names a path field or the sections holding one."""
    names = {"include_path", "json_schema", "output_dir", "cache_dir", "sources", "validation", "fidelity", "lm_eval"}
    pattern = re.compile(
        r"\b(" + "|".join(sorted(names)) + r")\b|(?<!os)\.path\b|\[\"(path|model)\"\]|\.get\(\"(path|model)\"\)"
    )
    for fn in (load_module._resolve_paths, load_module._check_files, plan.local_paths):
        source = inspect.getsource(fn)
        assert not pattern.search(source), f"{fn.__qualname__} names a path field: {pattern.search(source).group(0)}"
    plan_text = (REPO / "pipeline" / "run" / "plan.py").read_text()
    for dotted in ("validation.path", "json_schema", "include_path", "fidelity.path", "a.path", "s.path"):
        assert dotted not in plan_text, dotted
    load_text = (REPO / "pipeline" / "recipe" / "load.py").read_text()
    for name in ("include_path", "evaluation", "adapters", "calibration", '"path"', "output_dir", "cache_dir"):
        assert name not in load_text, name


def test_demo_recipe_paths_are_its_inputs():
    r = load(REPO / "recipes" / "demo.yaml", check_files=False)
    inputs = {v for _, v, m in path_values(r) if not m.place}
    assert local_paths(r, "/base") == {"/base"} | inputs
    assert r.output_dir not in inputs
