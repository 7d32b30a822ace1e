"""Pre-flight estimates: parameter counts against transformers, the method overheads, refusals (fast, no stage runs).

.venv/quantize/bin/python -m pytest tests/test_preflight.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from helpers.fakes import safetensors

from quantpipe import preflight
from quantpipe.cli import main
from quantpipe.common.shape import ModelShape
from quantpipe.recipe import Recipe, parse
from quantpipe.run.plan import build_steps

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30
LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 640,
    "vocab_size": 1000,
    "tie_word_embeddings": False,
    "max_position_embeddings": 1024,
}
QWEN2 = {**LLAMA, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "tie_word_embeddings": True}


def model_dir(tmp_path: Path, config: dict, name: str = "model") -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


def recipe(tmp_path: Path, model: Path, **over) -> Recipe:
    cal = tmp_path / "cal.jsonl"
    cal.write_text('{"text": "hello"}\n')
    data = {
        "name": "p",
        "output_dir": str(tmp_path / "out"),
        "base": {"model": str(model)},
        "calibration": {"sources": [{"path": str(cal)}], "num_samples": 64, "max_seq_len": 256},
        "artifacts": [
            {"name": "awq", "method": "awq"},
            {"name": "gptq", "method": "gptq"},
            {"name": "fp8", "method": "fp8"},
        ],
        "benchmark": {"engine": {"max_model_len": 512, "kv_cache_memory_bytes": 1 << 28}},
    }
    for k, v in over.items():
        data[k] = v
    return Recipe.model_validate(data)


@pytest.mark.parametrize("config", [LLAMA, QWEN2], ids=["llama", "qwen2"])
def test_parameter_count_matches_transformers(tmp_path, config):
    """From config.json alone within 1% (attention biases are left out), and exact from the safetensors headers."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    d = model_dir(tmp_path, config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d))
    n = model.num_parameters()
    from_config = ModelShape.read(d)
    assert from_config.params_from == "config"
    assert abs(from_config.params - n) / n < 0.01, (from_config.params, n)
    model.save_pretrained(tmp_path / "saved")
    from_weights = ModelShape.read(tmp_path / "saved")
    assert from_weights.params_from == "safetensors" and from_weights.params == n


def test_method_overheads_scale_with_what_they_depend_on(tmp_path):
    m = model_dir(tmp_path, LLAMA)
    r = recipe(tmp_path, m)
    est = preflight.estimate(r, build_steps(r, str(m)), str(m), gpu=None)
    t = {k: v["terms"] for k, v in est.items()}
    h, i = LLAMA["hidden_size"], LLAMA["intermediate_size"]
    assert (
        t["quantize:gptq"]["GPTQ Hessians"] == (5 * h * h + (8 * 32) ** 2 + i * i) * 4
    )  # in x in fp32 per Linear of one layer
    assert "GPTQ Hessians" not in t["quantize:awq"] and "AWQ activation cache" in t["quantize:awq"]
    assert "layer activations (2*N*S*h*b)" not in t["quantize:fp8"]  # FP8_DYNAMIC needs no calibration
    assert t["benchmark:baseline"]["KV cache"] == 1 << 28
    # twice the samples: twice the activations, the same Hessians
    r2 = recipe(
        tmp_path,
        m,
        calibration={"sources": [{"path": str(tmp_path / "cal.jsonl")}], "num_samples": 128, "max_seq_len": 256},
    )
    t2 = {k: v["terms"] for k, v in preflight.estimate(r2, build_steps(r2, str(m)), str(m), gpu=None).items()}
    assert t2["quantize:awq"]["AWQ activation cache"] == 2 * t["quantize:awq"]["AWQ activation cache"]
    assert t2["quantize:gptq"]["GPTQ Hessians"] == t["quantize:gptq"]["GPTQ Hessians"]
    # every layer's Hessians at once without sequential onloading
    r3 = recipe(tmp_path, m, artifacts=[{"name": "gptq", "method": "gptq", "pipeline": "basic"}])
    t3 = preflight.estimate(r3, build_steps(r3, str(m)), str(m), gpu=None)["quantize:gptq"]["terms"]
    assert t3["GPTQ Hessians"] == LLAMA["num_hidden_layers"] * t["quantize:gptq"]["GPTQ Hessians"]
    # a 4-bit artifact is smaller on disk than an 8-bit one, which is smaller than the baseline
    baseline = preflight.artifact_bytes(None, ModelShape.read(m), 2)
    assert est["package:gptq"]["disk_output_bytes"] < est["package:fp8"]["disk_output_bytes"] < baseline
    # in the cache a package's shards are hard links to the quantize entry's, unless it re-shards them smaller
    assert est["package:fp8"]["disk_cache_bytes"] == 0
    r4 = recipe(tmp_path, m, package={"max_shard_size": "2GB"})
    est4 = preflight.estimate(r4, build_steps(r4, str(m)), str(m), gpu=None)
    assert est4["package:fp8"]["disk_cache_bytes"] == est4["package:fp8"]["disk_output_bytes"] > 0


def test_cpu_stages_computing_in_float32_are_sized_in_float32(tmp_path, monkeypatch):
    """Where the CPU has no fast bfloat16 kernels, quantize and the hf evaluation hold the model in float32: twice the bytes."""
    from quantpipe.common import compute

    m = model_dir(tmp_path, LLAMA)
    (tmp_path / "val.jsonl").write_text('{"prompt": "1 + 1 =", "reference": "2"}\n')
    r = recipe(tmp_path, m, adapters=[], evaluation={"validation": {"path": str(tmp_path / "val.jsonl")}})
    terms = {}
    for fast in (True, False):
        monkeypatch.setattr(compute, "half_is_fast", lambda dtype, fast=fast: fast)
        terms[fast] = {
            k: v["terms"] for k, v in preflight.estimate(r, build_steps(r, str(m)), str(m), gpu=None).items()
        }
    shape = ModelShape.read(m)
    P = shape.params
    assert (
        terms[True]["quantize:gptq"]["model in bfloat16"] == 2 * P
        and terms[False]["quantize:gptq"]["model in float32"] == 4 * P
    )
    assert (
        terms[False]["quantize:gptq"]["layer activations (2*N*S*h*b)"]
        == 2 * terms[True]["quantize:gptq"]["layer activations (2*N*S*h*b)"]
    )
    assert terms[False]["evaluate:gptq"]["model in float32"] == 4 * P
    assert terms[False]["evaluate:gptq"]["baseline's output layer (for KL)"] == 4 * shape.vocab * shape.hidden
    assert terms[False]["benchmark:gptq"] == terms[True]["benchmark:gptq"]  # vLLM serves in base.dtype either way


def test_the_hf_evaluation_counts_the_whole_baseline_where_its_logits_are_not_its_output_layers(tmp_path):
    """An artifact's hf evaluation holds the baseline's output layer alone, unless the logits are soft-capped or scaled
    (the baseline then keeps no hidden states and the stage loads the whole model)."""
    (tmp_path / "val.jsonl").write_text('{"prompt": "1 + 1 =", "reference": "2"}\n')
    for i, (extra, whole) in enumerate(
        (({}, False), ({"final_logit_softcapping": 30.0}, True), ({"logit_scale": 0.0625}, True))
    ):
        m = model_dir(tmp_path, {**LLAMA, **extra}, name=f"model{i}")
        r = recipe(tmp_path, m, adapters=[], evaluation={"validation": {"path": str(tmp_path / "val.jsonl")}})
        terms = preflight.estimate(r, build_steps(r, str(m)), str(m), gpu=None)["evaluate:gptq"]["terms"]
        assert ("baseline (for KL)" in terms) is whole and ("baseline's output layer (for KL)" in terms) is not whole, (
            extra
        )


def test_gpu_benchmark_reserves_its_share_and_needs_room_for_one_sequence(tmp_path):
    m = model_dir(tmp_path, LLAMA)
    gpu = {"total_bytes": 80 * GIB, "free_bytes": 79 * GIB}
    r = recipe(tmp_path, m, benchmark={"engine": {"max_model_len": 512, "gpu_memory_utilization": 0.5}})
    est = preflight.estimate(r, build_steps(r, str(m)), str(m), gpu=gpu)
    assert est["benchmark:baseline"]["gpu_bytes"] == 40 * GIB
    have = {"ram_bytes": 64 * GIB, "gpu": {"total_bytes": 80 * GIB, "free_bytes": 30 * GIB}, "disk": {}}
    bad = preflight.problems(r, est, have, set(est))
    assert any(
        p.startswith("benchmark:baseline needs about 40.00 GiB of GPU memory")
        and "30.00 GiB is free" in p
        and "gpu_memory_utilization" in p
        for p in bad
    ), bad
    assert preflight.problems(r, est, {**have, "gpu": gpu}, set(est)) == []
    # a context too long for the reservation: refused, naming max_model_len
    huge = recipe(tmp_path, m, benchmark={"engine": {"max_model_len": 10**8, "gpu_memory_utilization": 0.5}})
    est = preflight.estimate(huge, build_steps(huge, str(m)), str(m), gpu=gpu)
    assert any("max_model_len" in p for p in preflight.problems(huge, est, {**have, "gpu": gpu}, set(est)))


def test_problems_name_stage_estimate_available_and_fix(tmp_path):
    m = model_dir(tmp_path, LLAMA)
    r = recipe(tmp_path, m)
    est = preflight.estimate(r, build_steps(r, str(m)), str(m), gpu=None)
    need = est["quantize:awq"]["ram_bytes"]
    have = {"ram_bytes": need - 1, "gpu": None, "disk": {}}
    bad = preflight.problems(r, est, have, {"quantize:awq"})
    assert len(bad) == 1 and bad[0].startswith(f"quantize:awq needs about {need / GIB:.2f} GiB of memory")
    assert f"but {(need - 1) / GIB:.2f} GiB is available" in bad[0] and "calibration.num_samples, now 64" in bad[0]
    assert preflight.problems(r, est, have, set()) == []  # only stages that will run are checked (cache hits are not)
    disk = {"path": str(tmp_path), "free_bytes": 1, "dev": 1}
    bad = preflight.problems(
        r, est, {"ram_bytes": None, "gpu": None, "disk": {"cache": disk, "output": {**disk, "dev": 2}}}, set(est)
    )
    assert any(str(tmp_path) in p and "cache_dir" in p for p in bad) and any("output_dir" in p for p in bad)


def test_disk_counts_entries_on_the_cache_disk_and_package_copies_on_the_output_disk(tmp_path):
    """A stage to build writes its entry to the cache's disk; a package missing from output_dir is copied there, from a
    cache hit too. A full cache disk's refusal names `quantpipe cache prune`."""
    from quantpipe.run.publish import store_dir, unpublished

    m = model_dir(tmp_path, LLAMA)
    r = recipe(tmp_path, m)
    steps = build_steps(r, str(m))
    for s in steps:
        s.key = f"key-of-{s.id}"
    est = preflight.estimate(r, steps, str(m), gpu=None)
    out = Path(r.output_dir)
    assert unpublished(steps, out) == {"package:awq", "package:gptq", "package:fp8"}
    store_dir(out, "fp8", "key-of-package:fp8").mkdir(parents=True)
    assert unpublished(steps, out) == {"package:awq", "package:gptq"}
    cache_disk, out_disk = {"path": "/c", "free_bytes": 100 * GIB, "dev": 1}, {"path": "/o", "free_bytes": 1, "dev": 2}
    have = {"ram_bytes": None, "gpu": None, "disk": {"cache": cache_disk, "output": out_disk}}
    bad = preflight.problems(r, est, have, set(), {"package:awq"})  # every stage a hit, one package still to copy
    assert len(bad) == 1 and "to /o but" in bad[0] and "output_dir" in bad[0]
    assert preflight.problems(r, est, have, set(), set()) == []
    full = {**have, "disk": {"cache": {**cache_disk, "free_bytes": 1}, "output": {**out_disk, "free_bytes": 100 * GIB}}}
    bad = preflight.problems(r, est, full, {"quantize:awq"}, set())
    assert len(bad) == 1 and "to /c but" in bad[0] and "`quantpipe cache prune`" in bad[0]


def test_a_run_that_cannot_fit_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """A ~10T-parameter model: no machine has the memory; exit 2, the stage named, nothing written."""
    big = {
        **LLAMA,
        "hidden_size": 32768,
        "num_hidden_layers": 640,
        "num_attention_heads": 256,
        "head_dim": 128,
        "num_key_value_heads": 8,
        "intermediate_size": 131072,
        "vocab_size": 256000,
    }
    m = model_dir(tmp_path, big)
    safetensors(m / "model.safetensors", {})  # a header without tensors: the count comes from the config
    (m / "tokenizer_config.json").write_text("{}")
    (tmp_path / "cal.jsonl").write_text('{"text": "hello"}\n')
    r = {
        "name": "big",
        "output_dir": "out",
        "base": {"model": "model"},
        "calibration": {"sources": [{"path": "cal.jsonl"}]},
        "artifacts": [{"name": "gptq", "method": "gptq"}],
        "evaluation": {},
        "benchmark": {"enabled": False},
    }
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(r))
    monkeypatch.setenv("QUANTPIPE_CACHE", str(tmp_path / "cache"))
    res = CliRunner().invoke(main, ["run", str(p)])
    assert res.exit_code == 2, res.output
    assert (
        "pre-flight" in res.output
        and "quantize:gptq needs about" in res.output
        and "is available" in res.output
        and "to fit:" in res.output
    )
    assert "Traceback" not in res.output
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()
    res = CliRunner().invoke(main, ["run", "--dry-run", str(p)])  # the plan shows it, and runs nothing
    assert res.exit_code == 0 and "would refuse" in res.output and "quantize:gptq" in res.output


# --- deadlines ----------------------------------------------------------------------------------------

LLAMA_8B = {
    **LLAMA,
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
}


def test_every_stage_has_a_deadline_of_ten_estimates_and_at_least_30_minutes(tmp_path):
    """A small model: merge, package and data-free quantization get the 30-minute floor. Llama-3-8B's shape on this CPU: GPTQ over 64x256 calibration
    tokens is estimated at hours, and its deadline is ten times that; on a GPU it is far shorter, still at least 30 min."""
    from quantpipe import deadline

    r = recipe(tmp_path, model_dir(tmp_path, LLAMA))
    steps = build_steps(r, r.base.model)
    est = deadline.estimate(r, steps, r.base.model, gpu=None)
    assert set(est) == {s.id for s in steps}
    small = deadline.deadlines(est, steps, None)
    assert all(small[k] == max(30 * 60, 10 * est[k]["time_s"]) for k in small)
    assert small["merge"] == small["package:fp8"] == small["quantize:fp8"] == 30 * 60
    assert small["benchmark:fp8"] > 30 * 60  # every vLLM server start is counted at 300 s

    big = tmp_path / "big"
    big.mkdir()
    r = recipe(big, model_dir(big, LLAMA_8B))
    steps = build_steps(r, r.base.model)
    cpu, gpu = (
        deadline.estimate(r, steps, r.base.model, gpu=None),
        deadline.estimate(r, steps, r.base.model, gpu={"total_bytes": 80 * GIB}),
    )
    cpu_deadlines = deadline.deadlines(cpu, steps, None)
    assert cpu["quantize:gptq"]["time_s"] > 3600 and cpu["quantize:gptq"]["terms"]["calibration passes"] > 0
    assert cpu_deadlines["quantize:gptq"] == 10 * cpu["quantize:gptq"]["time_s"]
    assert cpu["quantize:fp8"]["terms"]["calibration passes"] == 0  # FP8_DYNAMIC reads no calibration data
    assert 30 * 60 <= deadline.deadlines(gpu, steps, None)["quantize:gptq"] < cpu_deadlines["quantize:gptq"]
    assert set(deadline.deadlines(cpu, steps, 0).values()) == {None}  # --stage-timeout 0: no deadline
    assert set(deadline.deadlines(cpu, steps, 120).values()) == {120}


def test_dry_run_prints_each_stages_deadline_and_stage_timeout_overrides_it(tmp_path, monkeypatch):
    m = model_dir(tmp_path, LLAMA)
    safetensors(m / "model.safetensors", {})
    (m / "tokenizer_config.json").write_text("{}")
    r = recipe(tmp_path, m)
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(r.model_dump(mode="json", exclude_defaults=True)))
    monkeypatch.setenv("QUANTPIPE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("COLUMNS", "200")
    for args, shown in (([], "30 min"), (["--stage-timeout", "45"], "45 min"), (["--stage-timeout", "0"], "none")):
        res = CliRunner().invoke(main, ["run", "--dry-run", *args, str(p)])
        assert res.exit_code == 0, res.output
        lines = [ln for ln in res.output.splitlines() if "quantize:gptq" in ln or "package:fp8" in ln]
        assert len(lines) == 2 and all(ln.rstrip(" │|").endswith(shown) for ln in lines), res.output
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


def test_the_demo_fits_a_24_gib_machine(tiny):
    """Every stage of recipes/demo-tiny.yaml on the tiny model, against half of 24 GiB free (a busy machine): no refusal."""
    text = (REPO / "recipes" / "demo-tiny.yaml").read_text().replace("../.tiny", str(tiny.root))
    r = parse(text, REPO / "recipes")
    steps = build_steps(r, r.base.model)
    est = preflight.estimate(r, steps, r.base.model, gpu=None, ram_available=12 * GIB)
    assert set(est) == {s.id for s in steps}
    disk = {"path": "/", "free_bytes": 12 * GIB, "dev": 1}
    assert (
        preflight.problems(
            r, est, {"ram_bytes": 12 * GIB, "gpu": None, "disk": {"cache": disk, "output": disk}}, set(est)
        )
        == []
    )


def test_gpu_evaluation_with_vllm_reserves_its_share(tmp_path):
    """lm-eval's vllm engine takes gpu_memory_utilization of the GPU up front: refused when that much is not free."""
    m = model_dir(tmp_path, LLAMA)
    gpu = {"total_bytes": 80 * GIB, "free_bytes": 79 * GIB}
    r = recipe(tmp_path, m, evaluation={"lm_eval": {"tasks": ["t"], "backend": "vllm", "gpu_memory_utilization": 0.25}})
    est = preflight.estimate(r, build_steps(r, str(m)), str(m), gpu=gpu)
    assert est["evaluate:baseline"]["gpu_bytes"] == 20 * GIB
    have = {"ram_bytes": 64 * GIB, "gpu": {"total_bytes": 80 * GIB, "free_bytes": 10 * GIB}, "disk": {}}
    bad = preflight.problems(r, est, have, {"evaluate:baseline"})
    assert any(
        p.startswith("evaluate:baseline needs about 20.00 GiB of GPU memory")
        and "evaluation.lm_eval.gpu_memory_utilization" in p
        for p in bad
    ), bad
    default = recipe(tmp_path, m, evaluation={"lm_eval": {"tasks": ["t"], "backend": "vllm"}})
    # without a share set, its own server needs the weights, one max-length sequence of KV cache with headroom and
    # what vLLM needs beside them (a default until a server on this GPU has been measured), not 90 % of the card
    est = preflight.estimate(default, build_steps(default, str(m)), str(m), gpu=gpu)["evaluate:baseline"]
    terms = est["gpu_terms"]
    assert (
        est["gpu_bytes"] == sum(terms.values()) < 20 * GIB
        and terms["CUDA graphs, activations, context (default)"] == 10 * GIB
    )
    assert set(terms) == {"weights", "KV cache", "CUDA graphs, activations, context (default)"}


def test_gpu_memory_is_read_for_the_gpu_cuda_visible_devices_names(tmp_path, monkeypatch):
    """nvidia-smi lists every GPU whatever CUDA_VISIBLE_DEVICES says; pre-flight asks for the first visible one.
    (nvidia-smi is outside the product and absent on CI: a script stands in for it.)"""
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text('#!/bin/sh\ncase "$*" in *"-i 1"*) echo "81920, 2048";; *) echo "81920, 81000";; esac\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}:/usr/bin:/bin")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert preflight.gpu_memory() == {
        "total_bytes": 81920 * 2**20,
        "free_bytes": 81000 * 2**20,
        "card_bytes": 81920 * 2**20,
        "name": "",
    }
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    assert preflight.gpu_memory() == {
        "total_bytes": 81920 * 2**20,
        "free_bytes": 2048 * 2**20,
        "card_bytes": 81920 * 2**20,
        "name": "",
    }


LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
}


def test_a_gpu_server_without_memory_settings_is_sized_from_its_workloads_and_fits_a_40_gib_card(tmp_path):
    """The 8B shape's benchmark with no memory settings: weights + a KV cache for the highest concurrency of the longest
    sequence (64 x 640 tokens, with 1.25x headroom: 6.25 GiB) + what vLLM needs beside them, a default until a server
    on this GPU was measured, then the measured figure with a margin. It fits an A100 40GB; vLLM's 0.9 default did not
    share an 80 GB card, and the old 0.22 held no 8B weights on a 40 GB one."""
    m = model_dir(tmp_path, LLAMA3_8B)
    bench = {
        "workloads": [{"name": "chat", "input_len": 512, "output_len": 128, "num_prompts": 64}],
        "concurrency": [1, 16, 64],
    }
    r = recipe(tmp_path, m, benchmark=bench)
    card = {"total_bytes": 40 * GIB, "free_bytes": 39 * GIB, "card_bytes": 40 * GIB, "name": "NVIDIA A100-SXM4-40GB"}
    est = preflight.estimate(r, build_steps(r, str(m)), str(m), gpu=card)["benchmark:baseline"]
    terms = est["gpu_terms"]
    assert terms["KV cache"] == 64 * 640 * 1.25 * 2 * 32 * 8 * 128 * 2 == 6.25 * GIB
    assert terms["CUDA graphs, activations, context (default)"] == 10 * GIB
    assert est["gpu_bytes"] == terms["weights"] + terms["KV cache"] + 10 * GIB < 39 * GIB
    assert preflight.problems(r, {"benchmark:baseline": est}, {"gpu": card}, {"benchmark:baseline"}) == []
    # a measured server on this GPU replaces the default (the largest seen, +10 % and 0.5 GiB)
    metrics = {
        "platform": "cuda",
        "platform_info": {"device": "NVIDIA A100-SXM4-40GB"},
        "variants": {"default": {"memory": {"overhead_gib": 3.0}}},
    }
    assert preflight.learn_server_overhead(tmp_path, metrics) == 3 * GIB
    assert preflight.learn_server_overhead(
        tmp_path, {**metrics, "variants": {"default": {"memory": {"overhead_gib": 2.0}}}}
    )
    over, how = preflight.server_overhead(tmp_path, "NVIDIA A100-SXM4-40GB")
    assert over == int(3 * GIB * 1.1) + GIB // 2 and how == "measured on this NVIDIA A100-SXM4-40GB"
    assert preflight.server_overhead(tmp_path, "NVIDIA H100 80GB HBM3") == (10 * GIB, "default")
