"""Planning, cache keys and run bookkeeping. Fast tests use fake model folders; slow ones run real stages."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from filelock import FileLock
from helpers.fakes import safetensors

from quantpipe.cache import ContentHasher
from quantpipe.cli import main
from quantpipe.recipe import parse
from quantpipe.run.plan import build_steps, compute_keys, select

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake(tmp_path):
    m = tmp_path / "model"
    m.mkdir()
    (m / "config.json").write_text("{}")
    safetensors(m / "model.safetensors", {"w": [1]})
    (m / "tokenizer_config.json").write_text("{}")
    a = tmp_path / "adapter"
    a.mkdir()
    (a / "adapter_config.json").write_text("{}")
    safetensors(a / "adapter_model.safetensors", {"w": [2]})
    (tmp_path / "cal.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "val.jsonl").write_text('{"prompt": "p", "reference": "r"}\n')
    return tmp_path


def recipe_dict():
    return {
        "name": "t",
        "output_dir": "out",
        "cache_dir": "cache",
        "base": {"model": "model"},
        "adapters": [{"path": "adapter"}],
        "calibration": {"sources": [{"path": "cal.jsonl"}], "num_samples": 4},
        "artifacts": [{"name": "a", "method": "awq"}, {"name": "f", "method": "fp8"}],
        "evaluation": {"validation": {"path": "val.jsonl"}},
        "benchmark": {"concurrency": [1, 2]},
    }


def keys(root, d):
    r = parse(yaml.safe_dump(d), root)
    steps = build_steps(r, r.base.model)
    compute_keys(steps, r, r.base.model, ContentHasher(root / "memo.json"))
    return {s.id: s.key for s in steps}


def changed(before, after):
    return sorted(k for k in before if before[k] != after.get(k))


def test_plan_order(fake):
    r = parse(yaml.safe_dump(recipe_dict()), fake)
    ids = [s.id for s in build_steps(r, r.base.model)]
    assert ids == [
        "merge",
        "evaluate:baseline",
        "benchmark:baseline",
        "quantize:a",
        "evaluate:a",
        "benchmark:a",
        "package:a",
        "quantize:f",
        "evaluate:f",
        "benchmark:f",
        "package:f",
    ]


def test_benchmark_change_reruns_only_benchmark_and_package(fake):
    d = recipe_dict()
    k1 = keys(fake, d)
    d["benchmark"]["concurrency"] = [1, 8]
    k2 = keys(fake, d)
    assert changed(k1, k2) == ["benchmark:a", "benchmark:baseline", "benchmark:f", "package:a", "package:f"]


def test_fidelity_documents_count_by_content_in_the_evaluate_keys_only(fake):
    """The held-out documents are hashed into the evaluate keys (and the packages that cite them), never the benchmark's."""
    d = recipe_dict()
    k0 = keys(fake, d)
    (fake / "docs.jsonl").write_text('{"text": "one document"}\n')
    d["evaluation"]["fidelity"] = {"path": "docs.jsonl"}
    k1 = keys(fake, d)
    evaluate_and_package = ["evaluate:a", "evaluate:baseline", "evaluate:f", "package:a", "package:f"]
    assert changed(k0, k1) == evaluate_and_package
    (fake / "docs.jsonl").write_text('{"text": "another document"}\n')
    k2 = keys(fake, d)
    assert changed(k1, k2) == evaluate_and_package
    d["evaluation"]["fidelity"]["seq_len"] = 128
    assert changed(k2, keys(fake, d)) == evaluate_and_package


def test_vllm_backend_pairs_each_evaluation_with_its_benchmark_and_keeps_their_keys_apart(fake):
    """Under backend vllm each evaluate step names its benchmark step (one job, one server, when both are to build), yet the
    keys stay apart: a benchmark change redoes no evaluation, an evaluation change no benchmark."""
    d = recipe_dict()
    d["evaluation"]["lm_eval"] = {"tasks": ["t"], "backend": "vllm"}
    r = parse(yaml.safe_dump(d), fake)
    steps = build_steps(r, r.base.model)
    assert {s.id: s.joint for s in steps if s.joint} == {
        f"evaluate:{a}": f"benchmark:{a}" for a in ("baseline", "a", "f")
    }
    assert all(s.env == "serve" for s in steps if s.joint)
    k0 = keys(fake, d)
    d["benchmark"]["concurrency"] = [1, 8]
    k1 = keys(fake, d)
    assert changed(k0, k1) == ["benchmark:a", "benchmark:baseline", "benchmark:f", "package:a", "package:f"]
    d["evaluation"]["lm_eval"]["limit"] = 8
    assert changed(k1, keys(fake, d)) == ["evaluate:a", "evaluate:baseline", "evaluate:f", "package:a", "package:f"]
    d["evaluation"]["lm_eval"]["backend"] = "hf"  # hf: nothing is paired
    r = parse(yaml.safe_dump(d), fake)
    assert not any(s.joint for s in build_steps(r, r.base.model))


def test_keys_follow_what_the_host_computes_in(fake, monkeypatch):
    """Quantize and evaluate compute in float32 on a CPU without fast bfloat16 kernels and in bfloat16 where it has them
    (and on a GPU): a cache shared by such hosts gives neither one the other's weights or figures. The merge (float32
    everywhere) and the baseline's benchmark (keyed by the hardware itself) keep their keys."""
    import quantpipe.common.compute as compute
    import quantpipe.envs as envs

    monkeypatch.setattr(envs, "hardware", lambda: {"gpus": []})
    monkeypatch.setattr(compute, "cpu_flags", lambda: {"avx2", "fma"})
    d = recipe_dict()
    d["base"]["dtype"] = "bfloat16"
    k_avx2 = keys(fake, d)
    monkeypatch.setattr(compute, "cpu_flags", lambda: set(compute.AVX512_CORE))
    k_avx512 = keys(fake, d)
    assert changed(k_avx2, k_avx512) == sorted(set(k_avx2) - {"merge", "benchmark:baseline"})
    monkeypatch.setattr(envs, "hardware", lambda: {"gpus": [{"name": "H100"}]})
    k_gpu = keys(fake, d)
    assert changed(k_avx512, k_gpu) == sorted(set(k_avx2) - {"merge"})  # the benchmark's hardware too
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the GPU hidden: computed on the CPU, keyed so
    hidden = keys(fake, d)
    assert [k for k in changed(k_avx512, hidden) if k.split(":")[0] in ("quantize", "evaluate")] == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert keys(fake, d) == k_gpu
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    d["base"]["dtype"] = "float32"  # no half dtype: every CPU computes alike
    monkeypatch.setattr(envs, "hardware", lambda: {"gpus": []})
    k32 = keys(fake, d)
    monkeypatch.setattr(compute, "cpu_flags", lambda: {"avx2", "fma"})
    assert keys(fake, d) == k32


def test_gates_change_reruns_nothing(fake):
    d = recipe_dict()
    k1 = keys(fake, d)
    d["evaluation"]["gates"] = {"min_recovery": 0.99}
    assert changed(k1, keys(fake, d)) == ["package:a", "package:f"]  # the card states the gates


def test_artifact_change_touches_only_that_artifact(fake):
    d = recipe_dict()
    k1 = keys(fake, d)
    d["artifacts"][0]["group_size"] = 64
    assert changed(k1, keys(fake, d)) == ["benchmark:a", "evaluate:a", "package:a", "quantize:a"]


def test_input_content_change_invalidates_downstream(fake):
    d = recipe_dict()
    k1 = keys(fake, d)
    (fake / "adapter" / "adapter_model.safetensors").write_bytes(b"\3" * 16)
    assert changed(k1, keys(fake, d)) == sorted(k1)  # everything descends from the merge
    k2 = keys(fake, d)
    (fake / "cal.jsonl").write_text('{"text": "y"}\n')
    assert changed(k2, keys(fake, d)) == [
        "benchmark:a",
        "benchmark:f",
        "evaluate:a",
        "evaluate:f",
        "package:a",
        "package:f",
        "quantize:a",
        "quantize:f",
    ]


def test_select_pulls_in_dependencies(fake):
    r = parse(yaml.safe_dump(recipe_dict()), fake)
    steps = build_steps(r, r.base.model)
    ids = [s.id for s in select(steps, {"quantize"}, None)]
    assert ids == ["merge", "quantize:a", "quantize:f"]
    ids = [s.id for s in select(steps, {"package"}, {"f"})]
    assert ids == [
        "merge",
        "evaluate:baseline",
        "benchmark:baseline",
        "quantize:f",
        "evaluate:f",
        "benchmark:f",
        "package:f",
    ]


def test_second_run_on_the_same_output_fails_clearly(fake):
    path = fake / "r.yaml"
    path.write_text(yaml.safe_dump(recipe_dict()))
    (fake / "out").mkdir()
    with FileLock(str(fake / "out" / ".quantpipe.lock")):
        res = CliRunner().invoke(main, ["run", str(path)])
    assert res.exit_code == 2 and "another quantpipe run is using" in res.output and "--wait" in res.output
    assert not (fake / "out" / "runs").exists()


def test_unknown_artifact_and_stage_are_usage_errors(fake):
    path = fake / "r.yaml"
    path.write_text(yaml.safe_dump(recipe_dict()))
    res = CliRunner().invoke(main, ["run", "--dry-run", "--artifacts", "zzz", str(path)])
    assert res.exit_code == 2 and "no artifact named zzz" in res.output
    res = CliRunner().invoke(main, ["run", "--stages", "quantise", str(path)])
    assert res.exit_code == 2 and "unknown stage kind" in res.output


# --- real stages (slow) -------------------------------------------------------------------------


def small_recipe(tiny, tmp_path, **over):
    d = {
        "name": "rt",
        "output_dir": str(tmp_path / "out"),
        "cache_dir": str(tmp_path / "cache"),
        "base": {"model": str(tiny.llama)},
        "adapters": [{"path": str(tiny.llama_lora)}],
        "artifacts": [{"name": "fp8", "method": "fp8"}],
        "benchmark": {"enabled": False},
        "package": {"enabled": False},
    }
    d.update(over)
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(d))
    return p


def run_cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "quantpipe", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=900,
    )


@pytest.mark.slow
def test_rerun_is_all_cache_hits_and_corruption_is_rebuilt(tiny, tmp_path):
    recipe = small_recipe(tiny, tmp_path)
    first = run_cli("run", str(recipe))
    assert first.returncode == 0, first.stderr
    runs = sorted((tmp_path / "out" / "runs").glob("*/run.json"))
    rec = json.loads(runs[-1].read_text())
    assert rec["status"] == "ok"
    assert {k: v["cache"] for k, v in rec["stages"].items()} == {"merge": "miss", "quantize:fp8": "miss"}
    assert rec["stages"]["merge"]["metrics"]["merge_max_abs_diff"] < 1e-2
    assert rec["versions"]["quantize"]["llmcompressor"] == "0.14.0.1"

    dry = run_cli("run", "--dry-run", str(recipe))
    assert dry.returncode == 0 and dry.stdout.count("hit") + dry.stderr.count("hit") >= 2

    second = run_cli("run", str(recipe))
    assert second.returncode == 0, second.stderr
    rec2 = json.loads(sorted((tmp_path / "out" / "runs").glob("*/run.json"))[-1].read_text())
    assert {v["cache"] for v in rec2["stages"].values()} == {"hit"}

    # flip a byte in the cached quantized weights: detected on use, rebuilt, warned about
    out = Path(rec2["stages"]["quantize:fp8"]["out"])
    st = next(out.glob("*.safetensors"))
    data = bytearray(st.read_bytes())
    data[-1] ^= 0xFF
    st.write_bytes(bytes(data))
    third = run_cli("run", str(recipe))
    assert third.returncode == 0, third.stderr
    assert "corrupt" in third.stderr and "quantize:fp8" in third.stderr
    rec3 = json.loads(sorted((tmp_path / "out" / "runs").glob("*/run.json"))[-1].read_text())
    assert rec3["stages"]["merge"]["cache"] == "hit" and rec3["stages"]["quantize:fp8"]["cache"] == "rebuilt"

    forced = run_cli("run", "--force", "merge", "--stages", "merge", str(recipe))
    assert forced.returncode == 0
    rec4 = json.loads(sorted((tmp_path / "out" / "runs").glob("*/run.json"))[-1].read_text())
    assert list(rec4["stages"]) == ["merge"] and rec4["stages"]["merge"]["cache"] == "forced"
    index = [json.loads(x) for x in (tmp_path / "out" / "runs" / "index.jsonl").read_text().splitlines()]
    assert len(index) == 4 and all(i["status"] == "ok" for i in index)


@pytest.mark.slow
@pytest.mark.long
def test_vllm_backend_evaluates_through_the_benchmark_server_one_start_per_model(tiny, tmp_path):
    """Backend vllm with a benchmark: each model's evaluation and benchmark are one job with one `vllm serve` start, the
    evaluation answered before the warm-up and sweep, and committed then (what reads it may start while the sweep runs).
    A second run with only the benchmark changed reuses every evaluation and measures each model again, alone."""
    bench = {
        "engine": {"max_model_len": 512, "max_num_seqs": 8, "enforce_eager": True, "kv_cache_memory_bytes": 268435456},
        "workloads": [{"name": "fixed", "kind": "fixed", "input_len": 16, "output_len": 4, "num_prompts": 4}],
        "concurrency": [1],
    }
    over = {
        "base": {"model": str(tiny.llama), "dtype": "bfloat16"},
        "artifacts": [{"name": "int8", "method": "w8a8-int8"}],
        "calibration": {"sources": [{"path": str(tiny.calibration)}], "num_samples": 16, "max_seq_len": 64},
        "evaluation": {
            "lm_eval": {"tasks": ["tiny_facts_mc"], "include_path": str(tiny.tasks), "limit": 16, "backend": "vllm"},
            "validation": {"path": str(tiny.validation), "max_new_tokens": 8},
        },
        "benchmark": bench,
    }
    recipe = small_recipe(tiny, tmp_path, **over)
    first = run_cli("run", str(recipe))
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    run_dir = sorted((tmp_path / "out" / "runs").glob("*/run.json"))[-1].parent
    rec = json.loads((run_dir / "run.json").read_text())
    for m in ("baseline", "int8"):
        ev, bm = rec["stages"][f"evaluate:{m}"], rec["stages"][f"benchmark:{m}"]
        assert (ev["cache"], bm["cache"], ev["status"], bm["status"]) == ("miss", "miss", "ok", "ok")
        assert ev["end_s"] + 2 < bm["end_s"], (ev, bm)  # committed as soon as it was done, while the sweep ran
        assert ev["metrics"]["engine"]["shared"] is True and ev["metrics"]["timings"]["engine_start_s"] == 0
        assert not (Path(ev["out"]) / "server.log").exists()
        server_log = (Path(bm["out"]) / "logs" / "server-default.log").read_text()
        starts = [ln for ln in server_log.splitlines() if ln.startswith("$ ") and " serve " in ln]
        assert (
            len(starts) == 1 and server_log.count("POST /v1/completions") > 16
        )  # one start; the evaluation's requests
        assert bm["metrics"]["shared_s"] >= ev["metrics"]["timings"]["lm_eval_s"] > 0
        assert f"evaluate:{m} + benchmark:{m}: one server" in first.stdout + first.stderr
    int8 = rec["stages"]["evaluate:int8"]["metrics"]
    assert "top-20" in int8["fidelity"]["kl_support"] and {c["task"] for c in int8["comparison"]} == {
        "tiny_facts_mc",
        "validation",
    }

    bench["workloads"][0]["num_prompts"] = 5
    second = run_cli("run", str(small_recipe(tiny, tmp_path, **over)))
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    rec2 = json.loads(sorted((tmp_path / "out" / "runs").glob("*/run.json"))[-1].read_text())
    assert {k: v["cache"] for k, v in rec2["stages"].items() if k.startswith(("evaluate", "benchmark"))} == {
        "evaluate:baseline": "hit",
        "evaluate:int8": "hit",
        "benchmark:baseline": "miss",
        "benchmark:int8": "miss",
    }
    assert all(rec2["stages"][f"benchmark:{m}"]["metrics"]["shared_s"] is None for m in ("baseline", "int8"))


@pytest.mark.slow
def test_a_stage_past_the_stage_timeout_is_stopped_and_nothing_of_it_kept(tiny, tmp_path):
    """--stage-timeout: a stage that runs too long (here: any merge, given 1.2 s) is stopped with its
    processes, reported by name with the limit, nothing is committed, and the run exits non-zero."""
    import psutil

    recipe = small_recipe(tiny, tmp_path)
    t0 = time.monotonic()
    r = run_cli("run", "--stages", "merge", "--stage-timeout", "0.02", str(recipe))
    assert time.monotonic() - t0 < 120
    assert r.returncode not in (0, 2), r.stderr
    assert "merge ran longer than its deadline (1.2 s: --stage-timeout)" in r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    rec = json.loads(sorted((tmp_path / "out" / "runs").glob("*/run.json"))[-1].read_text())
    assert rec["status"] == "failed" and rec["stages"]["merge"]["status"] == "failed"
    merges = tmp_path / "cache" / "stages" / "merge"
    assert not [d for d in merges.iterdir() if d.is_dir()] if merges.exists() else True, "a stopped stage left an entry"
    left = [p for p in psutil.process_iter(["cmdline"]) if str(tmp_path) in " ".join(p.info["cmdline"] or [])]
    assert left == [], left
    assert run_cli("run", "--stage-timeout", "-1", str(recipe)).returncode == 2  # a deadline is >= 0 (0: none)
