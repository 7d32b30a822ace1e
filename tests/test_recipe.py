"""The recipe schema and `quantpipe check/schema/run --dry-run` on good and bad recipes (fast, no models)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from helpers.fakes import safetensors

from quantpipe.cli import main
from quantpipe.recipe import Recipe, RecipeError, load, parse

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake(tmp_path):
    """A model folder and an adapter folder that pass the file checks (contents are never loaded here)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    safetensors(model / "model.safetensors", {"w": [1]})
    (model / "tokenizer_config.json").write_text("{}")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    safetensors(adapter / "adapter_model.safetensors", {"w": [1]})
    cal = tmp_path / "cal.jsonl"
    cal.write_text('{"text": "hello"}\n')
    return tmp_path


def good(tmp_path) -> dict:
    return {
        "name": "t",
        "output_dir": "out",
        "base": {"model": "model"},
        "adapters": [{"path": "adapter"}],
        "calibration": {"sources": [{"path": "cal.jsonl"}], "num_samples": 4, "max_seq_len": 64},
        "artifacts": [
            {"name": "a", "method": "awq"},
            {"name": "g", "method": "gptq"},
            {"name": "f", "method": "fp8"},
            {"name": "i", "method": "w8a8-int8"},
        ],
    }


def write(tmp_path, data, name="r.yaml") -> Path:
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return p


def test_good_recipe_resolves_paths_and_defaults(fake):
    r = load(write(fake, good(fake)))
    assert r.base.model == str(fake / "model")
    assert r.adapters[0].path == str(fake / "adapter")
    assert r.output_dir == str(fake / "out")
    assert [a.method for a in r.artifacts] == ["awq", "gptq", "fp8", "w8a8-int8"]
    assert r.artifacts[0].group_size == 128 and r.artifacts[0].ignore == ["lm_head"]
    assert r.base.trust_remote_code is False and r.base.allow_pickle is False


def test_hub_id_is_not_treated_as_a_path(fake):
    d = good(fake)
    d["base"]["model"] = "meta-llama/Meta-Llama-3-8B-Instruct"
    r = load(write(fake, d))
    assert r.base.model == "meta-llama/Meta-Llama-3-8B-Instruct" and not r.base.is_local


BAD = {
    "unknown key": (lambda d: d["base"].update(dtpye="bfloat16"), "base.dtpye: unknown key"),
    "wrong type": (lambda d: d["calibration"].update(num_samples="many"), "calibration.num_samples"),
    "unknown method": (
        lambda d: d["artifacts"].append({"name": "x", "method": "bitsandbytes"}),
        "unknown method 'bitsandbytes'",
    ),
    "missing method": (lambda d: d["artifacts"].append({"name": "x"}), "missing `method`"),
    "empty artifacts": (lambda d: d.update(artifacts=[]), "artifacts"),
    "adapter not an adapter": (lambda d: d["adapters"][0].update(path="model"), "is not a LoRA adapter"),
    "missing model": (lambda d: d["base"].update(model="./nope"), "base.model"),
    "missing calibration file": (
        lambda d: d["calibration"]["sources"][0].update(path="nope.jsonl"),
        "calibration.sources.0.path",
    ),
    "negative size": (lambda d: d["calibration"].update(max_seq_len=-5), "calibration.max_seq_len"),
    "absurd group size": (lambda d: d["artifacts"][0].update(group_size=100), "group_size"),
    "duplicate names": (lambda d: d["artifacts"].append({"name": "a", "method": "fp8"}), "unique"),
    "path-escaping name": (lambda d: d["artifacts"][0].update(name="../evil"), "artifact name"),
    "auto-gptq": (lambda d: d["artifacts"][1].update(backend="auto-gptq"), "gptqmodel"),
    "calibration missing": (lambda d: d.pop("calibration"), "need calibration data"),
    "quantization flag": (
        lambda d: d.update(benchmark={"engine": {"extra_args": ["--quantization=awq"]}}),
        "--quantization",
    ),
    "gpu share for hf": (
        lambda d: d.update(evaluation={"lm_eval": {"tasks": ["t"], "backend": "hf", "gpu_memory_utilization": 0.3}}),
        "gpu_memory_utilization applies to the vllm backend only",
    ),
    "empty notes": (lambda d: d.update(notes=""), "notes: String should have at least 1 character"),
    "notes too long": (lambda d: d.update(notes="x" * 2001), "notes: String should have at most 2000 characters"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_recipe_names_the_field_and_writes_nothing(fake, case):
    mutate, needle = BAD[case]
    d = good(fake)
    mutate(d)
    path = write(fake, d)
    res = CliRunner().invoke(main, ["run", str(path)])
    assert res.exit_code == 2, res.output
    assert needle in res.output
    assert "Traceback" not in res.output
    assert not (fake / "out").exists()


@pytest.mark.parametrize(
    "text,needle",
    [
        ("name: t\nbase: {model: model\n", "not valid YAML at line"),
        ("- just\n- a list\n", "a recipe is a YAML mapping"),
        (
            "a: &a [1,1,1,1,1,1,1,1,1]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
            "d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\ne: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]\nf: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]\n",
            "alias bomb",
        ),
        ("!!python/object/apply:os.system ['echo pwned']\n", "not valid YAML"),
    ],
)
def test_bad_yaml(fake, text, needle):
    res = CliRunner().invoke(main, ["check", str(write(fake, text))])
    assert res.exit_code == 2 and needle in res.output and "Traceback" not in res.output


def test_binary_and_missing_files(fake):
    (fake / "bin.yaml").write_bytes(b"\xff\xfe\x00\x01garbage")
    res = CliRunner().invoke(main, ["check", str(fake / "bin.yaml")])
    assert res.exit_code == 2 and "Traceback" not in res.output
    res = CliRunner().invoke(main, ["check", str(fake / "nope.yaml")])
    assert res.exit_code == 2 and "no such recipe file" in res.output


def test_pickle_only_model_is_refused_unless_opted_in(fake):
    (fake / "model" / "model.safetensors").unlink()
    (fake / "model" / "pytorch_model.bin").write_bytes(b"\0")
    d = good(fake)
    with pytest.raises(RecipeError, match="pickle"):
        load(write(fake, d))
    d["base"]["allow_pickle"] = True
    assert load(write(fake, d)).base.allow_pickle


def test_check_prints_resolved_recipe(fake):
    res = CliRunner().invoke(main, ["check", str(write(fake, good(fake)))])  # click 8.2+: stdout apart from stderr
    assert res.exit_code == 0
    start = res.stdout.index("{")
    resolved = json.loads(res.stdout[start : res.stdout.rindex("}") + 1])
    assert resolved["artifacts"][0]["group_size"] == 128
    assert Recipe.model_validate(resolved).name == "t"


def test_schema_is_json_schema_with_every_method():
    res = CliRunner().invoke(main, ["schema"])
    assert res.exit_code == 0
    s = json.loads(res.output)
    assert s["additionalProperties"] is False
    text = json.dumps(s)
    for m in ("awq", "gptq", "fp8", "w8a8-int8"):
        assert f'"{m}"' in text


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "recipes").glob("*.yaml")))
def test_shipped_recipes_match_the_schema(name):
    """Every shipped recipe is valid (files they name are the user's, built by `make tiny`, or on the GPU host)."""
    r = load(REPO / "recipes" / name, check_files=False)
    assert r.artifacts


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "recipes").glob("*.yaml")))
def test_shipped_recipes_pass_the_checks_their_missing_files_allow(name):
    """Beyond the schema: their lm-eval tasks exist in the installed lm-eval (built-in ones, or in their include_path where it
    exists here), and their output and cache directories are apart from their inputs. Where every file they name is here
    (demo-tiny.yaml after `make tiny`, demo.yaml after `make smollm2`), the whole `quantpipe check` passes."""
    from quantpipe import lm_tasks, places

    r = load(REPO / "recipes" / name, check_files=False)
    assert places.problems(r) == []
    le = r.evaluation.lm_eval
    if le and (le.include_path is None or Path(le.include_path).is_dir()):
        assert lm_tasks.problems(r) == []
    try:
        load(REPO / "recipes" / name)
    except RecipeError:
        return  # names a model, adapter or data set that is not on this machine
    res = CliRunner().invoke(main, ["check", str(REPO / "recipes" / name)])
    assert res.exit_code == 0, res.output


def test_a_key_written_twice_is_an_error_naming_both_lines(tmp_path):
    text = "name: t\noutput_dir: out\nbase:\n  model: m\n  dtype: bfloat16\n  dtype: float16\nartifacts: [{name: f, method: fp8, name: g}]\n"
    with pytest.raises(RecipeError) as e:
        parse(text, tmp_path, check_files=False)
    assert "base.dtype is written twice (lines 5 and 6)" in str(e.value)
    assert "artifacts.0.name is written twice (line 7, columns 14 and 36)" in str(e.value)
    # anchors and merge keys are not duplicates: `<<` brings keys in, and a key after it overrides them
    ok = "x: &b {model: m}\nname: t\noutput_dir: out\nbase: {<<: *b, model: m2}\nartifacts: [{name: f, method: fp8}]\n"
    with pytest.raises(RecipeError, match="x: unknown key"):
        parse(ok, tmp_path, check_files=False)


def test_dry_run_writes_nothing(fake, monkeypatch):
    monkeypatch.setenv("QUANTPIPE_CACHE", str(fake / "cache"))
    res = CliRunner().invoke(main, ["run", "--dry-run", str(write(fake, good(fake)))])
    assert res.exit_code == 0, res.output
    for stage in ("merge", "quantize:a", "quantize:i", "package:f"):
        assert stage in res.output
    assert "miss" in res.output and "quantize" in res.output
    assert not (fake / "out").exists()
    assert not (fake / "cache").exists()


def test_python_dash_m_works():
    r = subprocess.run([sys.executable, "-m", "quantpipe", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "merge" in r.stdout


def test_parse_rejects_huge_input(tmp_path):
    with pytest.raises(RecipeError, match="larger than 1 MiB"):
        parse("a: " + "x" * (2 << 20), tmp_path)
