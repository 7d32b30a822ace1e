"""Bad input refused before anything runs, one class at a time: exit 2, one message naming the field and the fix, nothing written.

Each case starts from a recipe that passes `quantpipe check` (the control test) and changes one thing, as a
new user would get it wrong: an output or cache directory inside an input, output_dir an existing file, a
misspelt lm-eval task, a workload longer than the engine or the model takes, a key written twice, a group
size that does not divide the model's layer widths, and the other checks that can be answered from the
recipe, the files it names, their config.json and tokenizer, and lm-eval's task index. Through `check` and
`run` alike; every file under the case's folder and the Hugging Face home (size and mtime) is compared
before and after, so a refusal that wrote anything anywhere fails:

    .venv/quantize/bin/python -m pytest -q tests/test_refuse.py
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from helpers.fakes import TASK_YAML, safetensors

from quantpipe.cli import main

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 768,
    "vocab_size": 1024,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}
SMOLLM2 = {
    **LLAMA,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
}


def model(d: Path, config: dict, tokenizer: dict | None = None) -> Path:
    """A model folder that passes the file checks: config.json, a safetensors file with its projections, a tokenizer config."""
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(config))
    h, i, o = config["hidden_size"], config["intermediate_size"], config["num_attention_heads"] * config["head_dim"]
    safetensors(
        d / "model.safetensors",
        {
            "model.layers.0.self_attn.q_proj.weight": [o, h],
            "model.layers.0.self_attn.o_proj.weight": [h, o],
            "model.layers.0.mlp.down_proj.weight": [h, i],
            "model.layers.0.mlp.up_proj.weight": [i, h],
        },
    )
    (d / "tokenizer_config.json").write_text(json.dumps(tokenizer or {"model_max_length": 1 << 40}))
    return d


@pytest.fixture
def world(tmp_path) -> Path:
    model(tmp_path / "model", LLAMA)
    a = tmp_path / "adapter"
    a.mkdir()
    (a / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 8, "base_model_name_or_path": "someone/else"})
    )
    safetensors(
        a / "adapter_model.safetensors",
        {
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": [8, 256],
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": [256, 8],
        },
    )
    (tmp_path / "cal.jsonl").write_text("".join(json.dumps({"text": f"calibration row {i}"}) + "\n" for i in range(8)))
    (tmp_path / "val.jsonl").write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "reference": str(i + 1)}) + "\n" for i in range(4))
    )
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "refuse.jsonl").write_text(json.dumps({"q": "2+2=", "a": "4"}) + "\n")
    (tmp_path / "tasks" / "refuse.yaml").write_text(
        TASK_YAML.format(name="refuse_task", data=tmp_path / "tasks" / "refuse.jsonl")
    )
    (tmp_path / "notes.txt").write_text("a file, not a folder\n")
    return tmp_path


def good() -> dict:
    return {
        "name": "refuse",
        "output_dir": "out",
        "base": {"model": "model"},
        "adapters": [{"path": "adapter"}],
        "calibration": {"sources": [{"path": "cal.jsonl"}], "num_samples": 4, "max_seq_len": 64},
        "artifacts": [
            {"name": "awq", "method": "awq", "group_size": 128, "n_grid": 5},
            {"name": "gptq", "method": "gptq"},
            {"name": "rtn", "method": "rtn", "group_size": 64},
            {"name": "fp8", "method": "fp8"},
        ],
        "evaluation": {
            "lm_eval": {"tasks": ["refuse_task"], "include_path": "tasks", "limit": 2},
            "validation": {"path": "val.jsonl"},
            "gates": {"min_recovery": 0.9, "max_kl": 0.05},
        },
        "benchmark": {
            "engine": {"max_model_len": 512},
            "workloads": [
                {"name": "fixed", "input_len": 32, "output_len": 8, "num_prompts": 2},
                {
                    "name": "prefix",
                    "kind": "shared_prefix",
                    "prefix_len": 64,
                    "input_len": 16,
                    "output_len": 4,
                    "num_prompts": 2,
                },
            ],
            "variants": [{"name": "eager", "engine": {"enforce_eager": True}}],
        },
    }


def snapshot(*roots: Path) -> dict:
    """Every file and folder under the roots: (kind, size, mtime_ns)."""
    out = {}
    for root in roots:
        if not root.exists():
            continue
        for dirpath, dirnames, filenames in os.walk(root):
            for n in dirnames + filenames:
                p = Path(dirpath) / n
                st = p.lstat()
                out[str(p)] = (p.is_dir(), st.st_size if not p.is_dir() else 0, st.st_mtime_ns)
        out[str(root)] = ("root", 0, root.stat().st_mtime_ns)
    return out


def invoke(world: Path, command: str, data) -> tuple:
    p = world / "r.yaml"
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    roots = [world] + ([Path(os.environ["HF_HOME"])] if os.environ.get("HF_HOME") else [])
    before = snapshot(*roots)
    res = CliRunner().invoke(main, [command, str(p)], env={"QUANTPIPE_CACHE": str(world / "cache")})
    return res, before, snapshot(*roots)


def refused(world: Path, command: str, data, *needles: str) -> str:
    """Exit 2 with one `Error:` message holding every needle, no traceback, and no file or folder created or touched."""
    res, before, after = invoke(world, command, data)
    out = res.output
    assert res.exit_code == 2, f"exit {res.exit_code} ({res.exception!r}):\n{out}"
    assert "Traceback" not in out and isinstance(res.exception, SystemExit), out
    assert len(re.findall(r"^Error: ", out, re.M)) == 1, out
    for n in needles:
        assert n in out, f"{n!r} not in:\n{out}"
    assert after == before, (
        f"written: {sorted(set(after) ^ set(before)) or [k for k in after if after[k] != before.get(k)]}"
    )
    assert not (world / "out").exists() and not (world / "cache").exists()
    return out


COMMANDS = ["check", "run"]


def test_the_good_recipe_passes_and_writes_nothing(world):
    res, before, after = invoke(world, "check", good())
    assert res.exit_code == 0, res.output
    assert after == before


# --- output_dir and the cache inside (or around) an input ------------------------------------------

NESTED = {
    "output inside base.model": (
        lambda d: d.update(output_dir="model/runs-here"),
        ["output_dir", "inside base.model", "outside"],
    ),
    "output is base.model": (lambda d: d.update(output_dir="model"), ["output_dir", "the same folder as base.model"]),
    "output inside an adapter": (
        lambda d: d.update(output_dir="adapter/out"),
        ["output_dir", "inside adapters.0.path"],
    ),
    "output inside the task folder": (
        lambda d: d.update(output_dir="tasks/out"),
        ["inside evaluation.lm_eval.include_path"],
    ),
    "output contains the inputs": (
        lambda d: d.update(output_dir="."),
        ["output_dir", "contains base.model", "folder of its own"],
    ),
    "cache inside base.model": (
        lambda d: d.update(cache_dir="model/cache"),
        ["cache_dir", "inside base.model", "outside it"],
    ),
    "cache is the task folder": (
        lambda d: d.update(cache_dir="tasks"),
        ["cache_dir", "the same folder as evaluation.lm_eval.include_path"],
    ),
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", sorted(NESTED))
def test_output_or_cache_inside_an_input_is_refused(world, case, command):
    mutate, needles = NESTED[case]
    d = good()
    mutate(d)
    refused(world, command, d, *needles)


@pytest.mark.parametrize("command", COMMANDS)
def test_an_input_inside_the_caches_own_entries_is_refused(world, command):
    """A model read from a stage-cache entry could be swept or replaced mid-run; the rest of the cache folder is not ours."""
    entry = world / "qpcache" / "stages" / "merge" / "k" / "out"
    entry.parent.mkdir(parents=True)
    (world / "model").rename(entry)
    d = good()
    d.update(cache_dir="qpcache", base={"model": str(entry)})
    refused(world, command, d, "base.model", "inside the stage cache's own entries", "copy it out")
    # the cache folder also holds environments and the tiny models: an input elsewhere in it is fine
    other = world / "qpcache" / "tiny" / "model"
    other.parent.mkdir()
    entry.rename(other)
    d["base"]["model"] = str(other)
    res, before, after = invoke(world, "check", d)
    assert res.exit_code == 0, res.output
    assert after == before


# --- output_dir an existing file ---------------------------------------------------------------------


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    "where,needle", [("notes.txt", "is a file; give a directory"), ("notes.txt/out", "cannot be created there")]
)
def test_output_dir_that_is_a_file_is_refused(world, command, where, needle):
    d = good()
    d["output_dir"] = where
    refused(world, command, d, "output_dir", needle)
    d = good()
    d["cache_dir"] = where
    refused(world, command, d, "cache_dir", needle)


# --- lm-eval task names ----------------------------------------------------------------------------


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    "task,hint", [("refuse_tsak", "'refuse_task'"), ("hellaswg", "'hellaswag'"), ("no_such_task_anywhere_x", None)]
)
def test_unknown_lm_eval_task_is_refused_with_the_nearest_names(world, command, task, hint):
    d = good()
    d["evaluation"]["lm_eval"]["tasks"] = ["refuse_task", task]
    out = refused(world, command, d, "evaluation.lm_eval.tasks", f"unknown task {task!r}", "include_path")
    assert ("did you mean" in out and hint in out) if hint else "did you mean" not in out
    assert "'refuse_task'" not in out.split("unknown task")[1].split("(did")[0]  # the known one is not reported


@pytest.mark.parametrize("command", COMMANDS)
def test_a_task_whose_data_file_is_missing_is_refused_naming_the_file(world, command):
    (world / "tasks" / "refuse.jsonl").rename(
        world / "moved.jsonl"
    )  # a task folder copied or moved: its YAML keeps the old path
    refused(
        world,
        command,
        good(),
        "evaluation.lm_eval.tasks",
        "task 'refuse_task' reads its data from",
        str(world / "tasks" / "refuse.jsonl"),
        "dataset_kwargs.data_files",
    )


def test_builtin_lm_eval_tasks_are_found_without_the_full_index(world):
    d = good()
    d["evaluation"]["lm_eval"]["tasks"] = ["refuse_task", "arc_easy", "hellaswag"]
    res, before, after = invoke(world, "check", d)
    assert res.exit_code == 0, res.output
    assert after == before


@pytest.mark.parametrize("command", COMMANDS)
def test_per_task_gate_on_a_task_not_evaluated_is_refused(world, command):
    d = good()
    d["evaluation"]["gates"]["min_recovery_per_task"] = {"refuse_tsk": 0.9}
    refused(world, command, d, "evaluation.gates.min_recovery_per_task", "'refuse_tsk' (did you mean 'refuse_task'?)")


# --- workloads against max_model_len and the model's context ---------------------------------------

WORKLOADS = {
    "longer than max_model_len": (
        lambda b: b["workloads"][0].update(input_len=500, output_len=64),
        [
            "benchmark.workloads.0 ('fixed')",
            "needs 564 tokens",
            "benchmark.engine.max_model_len is 512",
            "at least 564",
        ],
    ),
    "prefix counts": (
        lambda b: b["workloads"][1].update(prefix_len=500),
        ["benchmark.workloads.1 ('prefix')", "prefix_len 500 + input_len 16 + output_len 4", "needs 520"],
    ),
    "a variant's own max_model_len": (
        lambda b: b["variants"].append({"name": "short", "engine": {"max_model_len": 64}}),
        ["benchmark.workloads.1", "benchmark.variants.1.engine.max_model_len is 64 (variant 'short')"],
    ),
    "beyond the model's context": (
        lambda b: (b["engine"].pop("max_model_len"), b["workloads"][0].update(input_len=1000, output_len=100)),
        ["benchmark.workloads.0", "needs 1100", "more than the model's context (max_position_embeddings 1024"],
    ),
    "max_model_len beyond the context": (
        lambda b: b["engine"].update(max_model_len=4096),
        ["benchmark.engine.max_model_len: 4096 is longer than the model's context", "vLLM refuses", "at most 1024"],
    ),
    "a variant beyond the context": (
        lambda b: b["variants"].append({"name": "long", "engine": {"max_model_len": 2048}}),
        ["benchmark.variants.1.engine.max_model_len: 2048", "at most 1024"],
    ),
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", sorted(WORKLOADS))
def test_workload_that_does_not_fit_the_engine_is_refused(world, case, command):
    mutate, needles = WORKLOADS[case]
    d = good()
    mutate(d["benchmark"])
    refused(world, command, d, *needles)


def test_the_tokenizers_limit_applies_when_no_max_model_len_is_set(world):
    (world / "model" / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
    d = good()
    d["benchmark"]["engine"].pop("max_model_len")
    d["benchmark"]["workloads"][0].update(input_len=300)
    refused(
        world,
        "check",
        d,
        "benchmark.workloads.0",
        "model_max_length, 256",
        "set benchmark.engine.max_model_len to at least 308",
    )
    d["benchmark"]["engine"]["max_model_len"] = 512  # set explicitly, vLLM takes it (up to config.json's context)
    res, _, _ = invoke(world, "check", d)
    assert res.exit_code == 0, res.output


def test_rope_scaling_lengthens_the_context_as_vllm_reads_it(world):
    """A RoPE factor (yarn, dynamic...) multiplies max_position_embeddings; llama3-style scaling does not (its 1024 is final)."""
    cfg = json.loads((world / "model" / "config.json").read_text())
    d = good()
    d["benchmark"]["engine"]["max_model_len"] = 4096
    for rope, ok in (({"rope_type": "yarn", "factor": 4.0}, True), ({"rope_type": "llama3", "factor": 8.0}, False)):
        (world / "model" / "config.json").write_text(json.dumps({**cfg, "rope_scaling": rope}))
        res, _, _ = invoke(world, "check", d)
        assert (res.exit_code == 0) == ok, res.output


# --- a key written twice -------------------------------------------------------------------------


@pytest.mark.parametrize("command", COMMANDS)
def test_a_key_written_twice_is_refused_with_both_lines(world, command):
    text = yaml.safe_dump(good(), sort_keys=False)
    lines = text.splitlines()
    k = next(i for i, ln in enumerate(lines) if ln.strip() == "method: awq")
    lines.insert(k + 2, lines[k].replace("awq", "gptq"))  # after n_grid... method: written again in the same artifact
    out = refused(
        world,
        command,
        "\n".join(lines) + "\n",
        f"artifacts.0.method is written twice (lines {k + 1} and {k + 3})",
        "delete the one",
    )
    assert "problem(s) in the recipe" not in out  # refused as YAML, before the schema reads the last value
    text = "name: refuse\n" + yaml.safe_dump(good(), sort_keys=False)  # name at the top and again below
    refused(world, command, text, "name is written twice (lines 1 and 2)")


def test_yaml_merge_keys_are_not_duplicates(world):
    d = good()
    text = yaml.safe_dump(d, sort_keys=False).replace(
        "- name: fp8\n  method: fp8\n", "- &f {name: fp8, method: fp8}\n- {<<: *f, name: fp8b}\n"
    )
    assert "<<" in text
    res, _, _ = invoke(world, "check", text)
    assert res.exit_code == 0, res.output


# --- group sizes the model's layers cannot take ----------------------------------------------------


@pytest.mark.parametrize("command", COMMANDS)
def test_group_size_that_does_not_divide_the_layers_is_refused(world, command):
    """SmolLM2-135M's shape (hidden 576, intermediate 1536): 128 divides 1536 but not 576; 32 and 64 divide both."""
    model(world / "smol", SMOLLM2)
    d = good()
    d["base"]["model"] = "smol"
    d["adapters"] = []
    out = refused(
        world,
        command,
        d,
        "artifacts.0.group_size: 128 does not divide",
        "576 (the input of",
        "q_proj",
        "use group_size 32 or 64",
        "ignore",
    )
    assert "artifacts.1.group_size: 128" in out and "group_size: null" in out  # gptq's default; rtn's 64 divides
    assert "artifacts.2" not in out and "1536" not in out


def test_group_size_problems_follow_ignore_and_null(world):
    """Only down_proj's 1376 inputs are odd: ignoring them, or per-channel GPTQ, is accepted."""
    model(world / "odd", {**LLAMA, "intermediate_size": 1376})
    d = good()
    d["base"]["model"] = "odd"
    d["adapters"] = []
    d["artifacts"] = [{"name": "rtn", "method": "rtn", "group_size": 64}]
    out = refused(world, "check", d, "artifacts.0.group_size: 64", "1376 (the input of down_proj)", "use group_size 32")
    assert "576" not in out
    d["artifacts"] = [
        {"name": "rtn", "method": "rtn", "group_size": 64, "ignore": ["lm_head", "re:.*down_proj"]},
        {"name": "gptq", "method": "gptq", "group_size": None},
        {"name": "awq", "method": "awq", "group_size": 32},
    ]
    res, _, _ = invoke(world, "check", d)
    assert res.exit_code == 0, res.output


# --- the other checks, one change each ---------------------------------------------------------------

OTHERS = {
    "workload names repeated": (
        lambda d: d["benchmark"]["workloads"][1].update(name="fixed"),
        ["workload names must be unique; repeated: fixed"],
    ),
    "variant named default": (
        lambda d: d["benchmark"]["variants"][0].update(name="default"),
        ["variant names must be unique and not 'default'"],
    ),
    "prefix_len on a fixed workload": (
        lambda d: d["benchmark"]["workloads"][0].update(prefix_len=8),
        ["benchmark.workloads.0", "prefix_len applies to kind shared_prefix only"],
    ),
    "shared_prefix without a prefix": (
        lambda d: d["benchmark"]["workloads"][1].pop("prefix_len"),
        ["benchmark.workloads.1", "needs prefix_len"],
    ),
    "validation workload without validation": (
        lambda d: (
            d["evaluation"].pop("validation"),
            d["evaluation"]["gates"].pop("max_kl"),
            d["benchmark"]["workloads"].append({"name": "v", "kind": "validation"}),
        ),
        ["workload 'v' has kind validation", "evaluation.validation is not set"],
    ),
    "input_len on a validation workload": (
        lambda d: d["benchmark"]["workloads"].append({"name": "v", "kind": "validation", "input_len": 8}),
        ["benchmark.workloads.2", "input_len does not apply to kind validation"],
    ),
    "fidelity gate without validation": (
        lambda d: d["evaluation"].pop("validation"),
        ["gates.max_kl", "add evaluation.validation"],
    ),
    "fidelity documents missing": (
        lambda d: d["evaluation"].update(fidelity={"path": "heldout.jsonl"}),
        ["evaluation.fidelity.path", "heldout.jsonl does not exist", 'one {"text": ...} per line'],
    ),
    "fidelity budget under two windows": (
        lambda d: d["evaluation"].update(fidelity={"path": "cal.jsonl", "max_tokens": 100, "seq_len": 64}),
        ["evaluation.fidelity", "max_tokens 100 holds fewer than two windows of seq_len 64"],
    ),
    "fidelity window beyond the context": (
        lambda d: d["evaluation"].update(fidelity={"path": "cal.jsonl", "max_tokens": 4096, "seq_len": 2048}),
        ["evaluation.fidelity.seq_len: 2048 is longer than the model's context", "use at most 1024"],
    ),
    "gate with nothing evaluated": (
        lambda d: d["evaluation"].update(lm_eval=None, validation=None, gates={"min_recovery": 0.9}),
        ["gates.min_recovery needs something evaluated"],
    ),
    "per-task gate without lm_eval": (
        lambda d: (d["evaluation"].pop("lm_eval"), d["evaluation"]["gates"].update(min_recovery_per_task={"arc": 0.9})),
        ["min_recovery_per_task names 'arc'"],
    ),
    "engine flag in extra_args": (
        lambda d: d["benchmark"]["engine"].update(extra_args=["--max_model_len=4096"]),
        ["benchmark.engine.extra_args", "set `max_model_len` in the engine instead"],
    ),
    "broken ignore pattern": (
        lambda d: d["artifacts"][0].update(ignore=["re:.*(mlp"]),
        ["artifacts.0.ignore", "not a valid regular expression"],
    ),
    "revision on a local model": (
        lambda d: d["base"].update(revision="main"),
        ["base.revision: applies to hub ids only"],
    ),
    "task listed twice": (
        lambda d: d["evaluation"]["lm_eval"].update(tasks=["refuse_task", "refuse_task"]),
        ["evaluation.lm_eval.tasks", "listed more than once"],
    ),
    "actorder group": (
        lambda d: d["artifacts"][1].update(actorder="group"),
        ["artifacts.1", "actorder group is not supported", "backend: gptqmodel"],
    ),
    "chat template needed, none there": (
        lambda d: d["evaluation"]["lm_eval"].update(apply_chat_template=True),
        ["evaluation.lm_eval.apply_chat_template: needs the model's chat template", "chat_template.jinja"],
    ),
    "tensor parallel across heads": (
        lambda d: d["benchmark"]["variants"][0]["engine"].update(tensor_parallel_size=3),
        [
            "benchmark.variants.0.engine.tensor_parallel_size: 3 does not divide the model's 8 attention heads",
            "use one of 1, 2, 4, 8",
        ],
    ),
    "calibration longer than the context": (
        lambda d: d["calibration"].update(max_seq_len=4096),
        ["calibration.max_seq_len: 4096 is longer than the model's context", "at most 1024"],
    ),
}


@pytest.mark.parametrize("command", COMMANDS)
def test_a_bad_fidelity_document_is_refused_naming_file_and_line(world, command):
    (world / "docs.jsonl").write_text(
        json.dumps({"text": "a held-out document"}) + "\n" + json.dumps({"body": "no text"}) + "\n"
    )
    d = good()
    d["evaluation"]["fidelity"] = {"path": "docs.jsonl"}
    refused(world, command, d, "docs.jsonl:2:", "non-empty string `text`")


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", sorted(OTHERS))
def test_other_knowable_mistakes_are_refused(world, case, command):
    mutate, needles = OTHERS[case]
    d = good()
    mutate(d)
    refused(world, command, d, *needles)


def test_chat_rows_need_a_chat_template_and_one_is_found_where_merge_takes_it(world):
    (world / "cal.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    refused(
        world,
        "check",
        good(),
        "calibration.sources (rows with `messages`): needs the model's chat template",
        str(world / "model"),
    )
    (world / "adapter" / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    res, _, _ = invoke(
        world, "check", good()
    )  # the adapter ships the tokenizer the merged model gets: its template counts
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("config", ["[]", "{not json"])
def test_config_json_that_is_not_an_object_is_refused(world, config):
    (world / "model" / "config.json").write_text(config)
    d = good()
    d["adapters"] = []
    refused(world, "check", d, "base.model", "config.json cannot be read as a JSON object")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_output_dir_without_write_permission_is_refused(world):
    (world / "locked").mkdir(mode=0o555)
    d = good()
    d["output_dir"] = "locked/out"
    refused(world, "check", d, "output_dir", "no permission to write in")


# --- links that leave an input folder ----------------------------------------------------------------


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("folder,field", [("model", "base.model"), ("adapter", "adapters.0.path")])
def test_a_link_leaving_the_model_or_adapter_folder_is_refused(world, command, folder, field):
    secret = world / "secret.txt"
    secret.write_text("the host's private key\n")
    (world / folder / "chat_template.jinja").symlink_to(secret)
    refused(world, command, good(), field, "chat_template.jinja -> " + str(secret), "replace each link with a copy")


@pytest.mark.parametrize("command", COMMANDS)
def test_a_linked_folder_leaving_the_model_is_refused(world, command):
    (world / "elsewhere").mkdir()
    (world / "model" / "extra").symlink_to(world / "elsewhere")
    refused(world, command, good(), "base.model", "extra -> " + str(world / "elsewhere"))


def test_links_inside_the_folder_and_the_hub_caches_own_blob_links_pass(world):
    (world / "model" / "templates").mkdir()
    (world / "model" / "templates" / "chat.jinja").write_text("{{ messages }}")
    (world / "model" / "chat_template.jinja").symlink_to(Path("templates") / "chat.jinja")
    res, before, after = invoke(world, "check", good())
    assert res.exit_code == 0, res.output
    # a snapshot of the hub cache: every file a link into the repository's blobs/
    repo = world / "hub" / "models--org--tiny"
    snap, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in sorted((world / "model").iterdir()):
        if f.is_file() and not f.is_symlink():
            (blobs / f.name).write_bytes(f.read_bytes())
            (snap / f.name).symlink_to(Path("..") / ".." / "blobs" / f.name)
    d = good()
    d["base"]["model"] = str(snap)
    res, before, after = invoke(world, "check", d)
    assert res.exit_code == 0, res.output


# --- task code needs consent ------------------------------------------------------------------------

CODE_TASKS = {
    "!function": "process_docs: !function steal.process_docs\n",
    "class:": "class: !function steal.StealTask\n",
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("kind", sorted(CODE_TASKS))
def test_task_code_in_the_include_path_needs_consent_and_never_runs_at_check(world, command, kind):
    marker = world / "ran.txt"
    (world / "tasks" / "steal.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\ndef process_docs(d):\n    return d\nclass StealTask:\n    pass\n"
    )
    task = TASK_YAML.format(name="refuse_task", data=world / "tasks" / "refuse.jsonl") + CODE_TASKS[kind]
    (world / "tasks" / "refuse.yaml").write_text(task)
    refused(world, command, good(), "evaluation.lm_eval.include_path", "(refuse.yaml: ", kind, "trust_task_code: true")
    assert not marker.exists()
    d = good()
    d["evaluation"]["lm_eval"]["trust_task_code"] = True
    res, before, after = invoke(world, "check", d)
    assert res.exit_code == 0 and after == before and not marker.exists(), res.output


def test_the_evaluate_stage_refuses_untrusted_task_code_before_lm_eval_loads_it(world):
    from quantpipe.recipe import parse
    from quantpipe.stages import StageError
    from quantpipe.stages.evaluate.compare import Scores
    from quantpipe.stages.evaluate.harness import run_lm_eval

    marker = world / "ran.txt"
    (world / "tasks" / "steal.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\ndef f(d):\n    return d\n")
    task = TASK_YAML.format(name="refuse_task", data=world / "tasks" / "refuse.jsonl")
    (world / "tasks" / "refuse.yaml").write_text(task + "process_docs: !function steal.f\n")
    le = parse(yaml.safe_dump(good()), world, check_files=False).evaluation.lm_eval
    with pytest.raises(StageError, match="trust_task_code: true"):
        run_lm_eval(le, {}, world, {"device": "cpu"}, Scores())
    assert not marker.exists()


def test_a_function_tag_in_a_comment_or_string_is_not_code(world):
    task = TASK_YAML.format(name="refuse_task", data=world / "tasks" / "refuse.jsonl")
    (world / "tasks" / "refuse.yaml").write_text(task + "# process_docs: !function utils.f\ndescription: '!function'\n")
    res, before, after = invoke(world, "check", good())
    assert res.exit_code == 0 and after == before, res.output


# --- damaged and inconsistent files ------------------------------------------------------------------


def truncate(path: Path, n: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:-n])


def adapter_config(world: Path, **over) -> None:
    p = world / "adapter" / "adapter_config.json"
    p.write_text(json.dumps({**json.loads(p.read_text()), **over}))


DAMAGED = {
    "a truncated model shard": (
        lambda w: truncate(w / "model" / "model.safetensors", 100),
        ["base.model", "model.safetensors is", "but its header says", "truncated", "download or copy it again"],
    ),
    "a truncated adapter": (
        lambda w: truncate(w / "adapter" / "adapter_model.safetensors", 1),
        ["adapters.0.path", "adapter_model.safetensors is", "truncated"],
    ),
    "a garbled model header": (
        lambda w: (w / "model" / "model.safetensors").write_bytes(
            b"\x10" + b"\0" * 7 + b"not json at all!" + b"\0" * 64
        ),
        ["base.model", "is not a readable safetensors file"],
    ),
    "an adapter whose rank is not its config's": (
        lambda w: adapter_config(w, r=4),
        ["adapters.0.path", "has rank 8 in", "r: 4", "from different adapters"],
    ),
    "an adapter with weights its config does not target": (
        lambda w: adapter_config(w, target_modules=["v_proj", "k_proj"]),
        ["adapters.0.path", "self_attn.q_proj", "does not target", "['v_proj', 'k_proj']"],
    ),
    "an adapter that is not a LoRA": (
        lambda w: adapter_config(w, peft_type="PREFIX_TUNING"),
        ["adapters.0.path", "is a PREFIX_TUNING adapter", "LoRA adapters only"],
    ),
    "a base without tokenizer files": (
        lambda w: (w / "model" / "tokenizer_config.json").unlink(),
        ["base.model", "has no tokenizer files", "calibration (quantize tokenizes it)", "package (ships it)"],
    ),
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", sorted(DAMAGED))
def test_damaged_or_inconsistent_files_are_refused_before_any_stage(world, case, command):
    damage, needles = DAMAGED[case]
    damage(world)
    refused(world, command, good(), *needles)


def test_an_adapter_with_its_own_ranks_and_full_module_names_passes(world):
    adapter_config(world, r=4, rank_pattern={"q_proj": 8}, target_modules=["self_attn.q_proj"])
    res, before, after = invoke(world, "check", good())
    assert res.exit_code == 0 and after == before, res.output


def tiny_recipe(tiny, base: Path, rows: list[dict], tmp: Path) -> dict:
    (tmp / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {
        "name": "tiny-check",
        "output_dir": "out",
        "base": {"model": str(base)},
        "artifacts": [{"name": "fp8", "method": "fp8"}],
        "evaluation": {"validation": {"path": "val.jsonl", "max_new_tokens": 16}},
        "benchmark": {"enabled": False},
    }


@pytest.mark.parametrize("command", COMMANDS)
def test_a_validation_prompt_beyond_the_context_is_refused_with_its_length(tiny, tmp_path, command):
    """The tiny Llama's context is 2048 positions: a 2100-word prompt is refused (file:line, its length, the context);
    one of 2000 tokens fits without its 16 new tokens only when shorter."""
    rows = [{"prompt": "What is 3 plus 1?", "reference": "4"}, {"prompt": "one " * 2100, "reference": "x"}]
    out = refused(tmp_path, command, tiny_recipe(tiny, tiny.llama, rows, tmp_path), "val.jsonl:2: the prompt is")
    n = int(re.search(r"the prompt is (\d+) tokens", out).group(1))
    assert n > 2048 and f"needs {n + 16} positions" in out and "(2048: max_position_embeddings" in out, out
    assert "val.jsonl:1" not in out


def test_a_chat_template_that_rejects_a_row_is_refused_at_check(tiny, tmp_path):
    """As a validation row and as a calibration row: named file:line with the template's own message, before any stage."""
    import shutil

    base = tmp_path / "llama"
    shutil.copytree(tiny.llama, base)
    (base / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] != 'user' %}{{ raise_exception('only user turns') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    rows = [
        {"messages": [{"role": "user", "content": "hi"}], "reference": "x"},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], "reference": "x"},
    ]
    out = refused(tmp_path, "check", tiny_recipe(tiny, base, rows, tmp_path), "val.jsonl:2: the chat template of")
    assert "only user turns" in out and "val.jsonl:1" not in out, out
    # the same rows as calibration data: the quantize stage would fail on them
    (tmp_path / "cal.jsonl").write_text("".join(json.dumps({"messages": r["messages"]}) + "\n" for r in rows))
    d = tiny_recipe(tiny, base, rows[:1], tmp_path)
    d["calibration"] = {"sources": [{"path": "cal.jsonl"}], "num_samples": 2, "max_seq_len": 64}
    out = refused(tmp_path, "check", d, "cal.jsonl:2: the model's chat template failed on this row")
    assert "only user turns" in out, out


def test_the_documents_of_local_tasks_are_counted_and_hub_tasks_are_not(world):
    """What the evaluate stage's time estimate (its deadline) counts: one JSON line per document of a local task."""
    from quantpipe.lm_tasks import local_documents
    from quantpipe.recipe import parse

    d = good()
    (world / "tasks" / "refuse.jsonl").write_text(
        "".join(json.dumps({"q": f"{i}+2=", "a": str(i + 2)}) + "\n" for i in range(2))
    )
    assert local_documents(parse(yaml.safe_dump(d), world).evaluation.lm_eval) == 2
    d["evaluation"]["lm_eval"]["limit"] = 1
    assert local_documents(parse(yaml.safe_dump(d), world).evaluation.lm_eval) == 1
    d["evaluation"]["lm_eval"]["tasks"] = ["refuse_task", "arc_easy"]
    assert local_documents(parse(yaml.safe_dump(d), world).evaluation.lm_eval) is None


# --- lm-eval's index, the light way ---------------------------------------------------------------


@pytest.mark.parametrize("folder", ["arc", "hellaswag", "mmlu", "bbh", "leaderboard"])
def test_the_light_task_index_is_lm_evals_own(folder):
    """light_index (lm-eval's YAML loader + TaskIndex's rule, without importing lm_eval.tasks) registers exactly what
    lm-eval's TaskManager does, kinds and tags included, on built-in folders with includes, groups and tags."""
    import importlib.util

    from lm_eval.tasks import TaskManager

    from quantpipe.lm_tasks import _lm_eval_yaml_loader, _yaml_files, light_index

    root = Path(importlib.util.find_spec("lm_eval").origin).parent / "tasks" / folder
    mine = light_index(_yaml_files(root), _lm_eval_yaml_loader().load_yaml)
    theirs = TaskManager(include_path=str(root), include_defaults=False).task_index
    assert {k: e.kind for k, e in mine.items()} == {k: e.kind.name for k, e in theirs.items()}
    assert {k: e.tags for k, e in mine.items() if e.kind == "TAG"} == {
        k: set(e.tags) for k, e in theirs.items() if e.kind.name == "TAG"
    }


def test_check_of_local_tasks_does_not_import_lm_eval_tasks(world):
    """The recipe's tasks are all in its include_path: `quantpipe check` reads them without importing lm_eval.tasks or datasets (~2 s)."""
    import subprocess
    import sys

    p = world / "r.yaml"
    p.write_text(yaml.safe_dump(good()))
    code = (
        "import sys; from click.testing import CliRunner; from quantpipe.cli import main; "
        f"r = CliRunner().invoke(main, ['check', {str(p)!r}]); assert r.exit_code == 0, r.output; "
        "heavy = {'lm_eval.tasks', 'datasets', 'torch', 'transformers'} & set(sys.modules); assert not heavy, heavy"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "QUANTPIPE_CACHE": str(world / "cache")},
    )
    assert r.returncode == 0, r.stderr[-3000:]
