"""Legacy backends: `backend: autoawq` (AutoAWQ's AWQ-GEMM checkpoint) and `backend: gptqmodel` (GPTQ).

Fast tests need no model: the schema refuses options a backend cannot honour, the runner routes a
legacy artifact's quantize stage to its own environment (and its evaluate stage to the one that reads
the format), and a missing environment stops the run before anything runs, naming the command that
builds it. The slow tests run `quantpipe run --stages quantize` on the tiny Llama in the real legacy
environments (`scripts/setup_envs.sh legacy`), then load every artifact with transformers in the
gptqmodel environment (transformers 5 reads both formats through gptqmodel), generate, and compare
next-token KL against the baseline with round-to-nearest of the same scheme as the reference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers.fakes import safetensors

from quantpipe.envs import EnvError, python_for
from quantpipe.recipe import RecipeError, parse
from quantpipe.run.plan import build_steps
from quantpipe.stages import StageError

REPO = Path(__file__).resolve().parents[1]
QUALITY = Path(__file__).with_name("legacy_quality.py")


def legacy_envs_missing() -> str | None:
    try:
        python_for("autoawq"), python_for("gptqmodel")
    except EnvError as e:
        return f"{e}"
    return None


needs_legacy = pytest.mark.skipif(
    legacy_envs_missing() is not None,
    reason="the legacy environments are missing; build them with `scripts/setup_envs.sh legacy` (make setup-legacy)",
)


def recipe_dict(tmp_path, *artifacts) -> dict:
    (tmp_path / "m").mkdir(exist_ok=True)
    (tmp_path / "m" / "config.json").write_text("{}")
    safetensors(tmp_path / "m" / "model.safetensors", {"w": [1]})
    (tmp_path / "m" / "tokenizer_config.json").write_text("{}")
    (tmp_path / "cal.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "val.jsonl").write_text('{"prompt": "p", "reference": "r"}\n')
    return {
        "name": "t",
        "output_dir": "out",
        "cache_dir": "cache",
        "base": {"model": "m"},
        "calibration": {"sources": [{"path": "cal.jsonl"}]},
        "artifacts": [{"name": f"a{i}", **a} for i, a in enumerate(artifacts)],
        "evaluation": {"validation": {"path": "val.jsonl"}},
        "benchmark": {"enabled": False},
    }


# --- the schema refuses what a backend cannot do ---------------------------------------------------


@pytest.mark.parametrize(
    "artifact,needle",
    [
        ({"method": "awq", "backend": "autoawq", "symmetric": True}, "needs zero points"),
        ({"method": "awq", "backend": "autoawq", "n_grid": 5}, "fixed grid of 20 points"),
        ({"method": "awq", "backend": "autoawq", "ignore": ["re:.*mlp.*", "lm_head"]}, "not by `re:` pattern"),
        ({"method": "gptq", "backend": "gptqmodel", "block_size": 64}, "fixed blocks of 128"),
        (
            {"method": "gptq", "backend": "gptqmodel", "targets": ["re:.*proj"]},
            "Linear layers of the decoder blocks only",
        ),
        ({"method": "gptq", "backend": "gptqmodel", "ignore": []}, "cannot quantize lm_head"),
        ({"method": "awq", "backend": "autoawq", "pipeline": "sequential"}, "`pipeline` is an llm-compressor option"),
        (
            {"method": "gptq", "backend": "gptqmodel", "sequential_targets": ["LlamaDecoderLayer"]},
            "`sequential_targets` is an llm-compressor option",
        ),
    ],
)
def test_unsupported_options_are_refused_at_check(tmp_path, artifact, needle):
    with pytest.raises(RecipeError, match=r"artifacts\.0: .*" + needle.replace("`", ".").replace("(", r"\(")):
        parse(yaml.safe_dump(recipe_dict(tmp_path, artifact)), tmp_path)
    # the same options are fine with the default backend
    ok = {k: v for k, v in artifact.items() if k != "backend"}
    parse(yaml.safe_dump(recipe_dict(tmp_path, ok)), tmp_path)


def test_defaults_are_accepted_for_both_backends(tmp_path):
    r = parse(
        yaml.safe_dump(
            recipe_dict(
                tmp_path,
                {"method": "awq", "backend": "autoawq"},
                {"method": "gptq", "backend": "gptqmodel", "bits": 8, "group_size": None},
            )
        ),
        tmp_path,
    )
    assert [a.backend for a in r.artifacts] == ["autoawq", "gptqmodel"]


# --- routing and the missing-environment error ------------------------------------------------------


def test_legacy_artifacts_run_in_their_environments(tmp_path):
    r = parse(
        yaml.safe_dump(
            recipe_dict(
                tmp_path,
                {"method": "awq", "backend": "autoawq"},
                {"method": "gptq", "backend": "gptqmodel"},
                {"method": "rtn"},
            )
        ),
        tmp_path,
    )
    env = {s.id: s.env for s in build_steps(r, r.base.model)}
    assert env["quantize:a0"] == "autoawq" and env["quantize:a1"] == "gptqmodel" and env["quantize:a2"] == "quantize"
    # transformers 5 reads AWQ and GPTQ checkpoints through gptqmodel: their evaluation runs where it is
    assert env["evaluate:a0"] == env["evaluate:a1"] == "gptqmodel" and env["evaluate:a2"] == "quantize"
    assert env["merge"] == env["evaluate:baseline"] == env["package:a0"] == "quantize"


def test_missing_legacy_environment_stops_the_run_before_any_stage(tmp_path):
    d = recipe_dict(tmp_path, {"method": "rtn"}, {"method": "awq", "backend": "autoawq"})
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(d))
    env = {**os.environ, "QUANTPIPE_PYTHON_AUTOAWQ": str(tmp_path / "nowhere" / "python")}
    for args in (["run", "--dry-run"], ["run"]):
        res = subprocess.run(
            [sys.executable, "-m", "quantpipe", *args, str(tmp_path / "r.yaml")],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert res.returncode == 1, res.stderr
        assert "the 'autoawq' environment is missing" in res.stderr and "scripts/setup_envs.sh legacy" in res.stderr, (
            res.stderr
        )
        assert "Traceback" not in res.stderr
    assert not (tmp_path / "cache" / "stages").exists() or not any((tmp_path / "cache" / "stages").iterdir())
    # the same recipe without the legacy artifact plans fine
    res = subprocess.run(
        [sys.executable, "-m", "quantpipe", "run", "--dry-run", "--artifacts", "a0", str(tmp_path / "r.yaml")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("backend,method", [("autoawq", "awq"), ("gptqmodel", "gptq")])
def test_stage_outside_its_environment_says_where_it_runs(tmp_path, backend, method):
    from quantpipe.stages.quantize import run

    if legacy_envs_missing() is None and Path(sys.prefix).resolve() == python_for(backend).parent.parent.resolve():
        pytest.skip("running inside the legacy environment itself")
    d = recipe_dict(tmp_path, {"method": method, "backend": backend})
    r = parse(yaml.safe_dump(d), tmp_path)
    out = tmp_path / "q"
    out.mkdir()
    with pytest.raises(
        StageError, match=rf"backend {backend} runs in the {backend} environment.*scripts/setup_envs.sh legacy"
    ):
        from quantpipe.run.plan import stage_input

        run(stage_input("quantize", r, "a0", tmp_path / "m"), tmp_path / "m", out)
    assert not any(out.iterdir())


# --- the real thing: quantize in the legacy environments, read back in the gptqmodel one -----------

# each legacy artifact and its uncalibrated twin of the same scheme (4-bit, group 128)
ARTIFACTS = {
    "awq-legacy": {"method": "awq", "backend": "autoawq", "group_size": 128},
    "gptq-legacy": {"method": "gptq", "backend": "gptqmodel", "bits": 4, "group_size": 128},
    "rtn-asym": {"method": "rtn", "bits": 4, "group_size": 128, "symmetric": False},
    "rtn": {"method": "rtn", "bits": 4, "group_size": 128},
}


@pytest.fixture(scope="module")
def built(tiny, tmp_path_factory):
    """`quantpipe run --stages quantize` over ARTIFACTS: name -> (dir, metrics), plus the run record."""
    root = tmp_path_factory.mktemp("legacy")
    d = {
        "name": "legacy",
        "output_dir": str(root / "out"),
        "cache_dir": str(root / "cache"),
        "base": {"model": str(tiny.llama)},
        "calibration": {"sources": [{"path": str(tiny.calibration)}], "num_samples": 32, "max_seq_len": 128, "seed": 0},
        "artifacts": [{"name": n, **a} for n, a in ARTIFACTS.items()],
        "benchmark": {"enabled": False},
        "package": {"enabled": False},
    }
    (root / "r.yaml").write_text(yaml.safe_dump(d))
    res = subprocess.run(
        [sys.executable, "-m", "quantpipe", "run", "--stages", "quantize", str(root / "r.yaml")],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    rec = json.loads(sorted((root / "out" / "runs").glob("*/run.json"))[-1].read_text())
    assert res.returncode == 0, (res.stderr[-3000:], {k: v.get("log_tail") for k, v in rec["stages"].items()})
    return {
        n: (Path(rec["stages"][f"quantize:{n}"]["out"]), rec["stages"][f"quantize:{n}"]["metrics"]) for n in ARTIFACTS
    } | {"_record": rec}


@pytest.mark.slow
@pytest.mark.long
@needs_legacy
def test_legacy_artifacts_are_their_formats(built, tiny):
    rec = built["_record"]
    assert (
        rec["stages"]["quantize:awq-legacy"]["env"] == "autoawq"
        and rec["stages"]["quantize:gptq-legacy"]["env"] == "gptqmodel"
    )

    awq_dir, awq = built["awq-legacy"]
    q = json.loads((awq_dir / "config.json").read_text())["quantization_config"]
    assert (q["quant_method"], q["version"], q["bits"], q["group_size"], q["zero_point"]) == (
        "awq",
        "gemm",
        4,
        128,
        True,
    )
    rope = json.loads((awq_dir / "config.json").read_text())
    assert rope.get("rope_theta", rope.get("rope_parameters", {}).get("rope_theta")) == 500000.0, (
        "transformers 4 must see the model's own rope_theta"
    )

    gptq_dir, gptq = built["gptq-legacy"]
    q = json.loads((gptq_dir / "config.json").read_text())["quantization_config"]
    assert (q["quant_method"], q["bits"], q["group_size"], q["sym"], q["desc_act"]) == (
        "gptq",
        4,
        128,
        True,
        True,
    )  # actorder static
    assert (q["meta"]["damp_percent"], q["meta"]["static_groups"], q["meta"]["act_group_aware"]) == (0.01, True, False)

    for name in ("awq-legacy", "gptq-legacy"):
        d, m = built[name]
        for f in (
            "config.json",
            "calibration.json",
            "backend.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
            "chat_template.jinja",
        ):
            assert (d / f).is_file(), f"{name}: {f} missing"
        for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
            assert (d / f).read_bytes() == (tiny.llama / f).read_bytes(), f"{name}: {f} differs from the source model's"
        # 4-bit decoder layers; embeddings and lm_head stay 16-bit (most of this tiny model): as small as RTN's 4-bit
        rtn = built["rtn"][1]["weights_bytes"]
        assert m["weights_bytes"] < m["baseline_weights_bytes"] and abs(m["weights_bytes"] - rtn) < 0.02 * rtn, (
            name,
            m,
            rtn,
        )
        assert m["size_bytes"] == sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
        assert m["quantize_s"] > 0 and m["wall_s"] > m["quantize_s"] and m["peak_rss_gib"] > 0
        backend = json.loads((d / "backend.json").read_text())
        assert backend["backend"] == m["backend"] and backend["versions"][m["backend"]] == m["versions"][m["backend"]]
    assert built["awq-legacy"][1]["versions"]["transformers"].startswith("4.")
    assert 0 < built["awq-legacy"][1]["calibration_blocks"] * 128 <= built["awq-legacy"][1]["n_calibration_tokens"]


@pytest.mark.slow
@pytest.mark.long
@needs_legacy
def test_same_calibration_samples_as_llm_compressor(built, tiny):
    """Both legacy environments tokenized and templated the samples exactly as the default path does."""
    from transformers import AutoTokenizer

    from quantpipe import calibration as cal
    from quantpipe.recipe import Calibration

    c = Calibration.model_validate(
        {"sources": [{"path": str(tiny.calibration)}], "num_samples": 32, "max_seq_len": 128, "seed": 0}
    )
    expected = cal.prepare(c, AutoTokenizer.from_pretrained(tiny.llama))
    assert sum(r.messages is not None for r in expected.rows) > 0  # chat rows: the template matters
    for name in ARTIFACTS:
        d, m = built[name]
        prov = json.loads((d / "calibration.json").read_text())
        if name.startswith("rtn"):
            continue
        assert prov["calibration_sha256"] == m["calibration_sha256"] == expected.sha256, name
        assert prov["n_samples"] == 32 and prov["n_chat_samples"] == sum(r.messages is not None for r in expected.rows)


@pytest.mark.slow
@pytest.mark.long
@needs_legacy
def test_legacy_artifacts_load_generate_and_beat_rtn(built, tiny):
    dirs = {n: str(built[n][0]) for n in ARTIFACTS}
    res = subprocess.run(
        [str(python_for("gptqmodel")), str(QUALITY), str(tiny.llama), str(tiny.heldout), json.dumps(dirs)],
        capture_output=True,
        text=True,
        timeout=1200,
        env={**os.environ, "GPTQMODEL_CPU_WORKERS": "2"},
    )
    assert res.returncode == 0, res.stderr[-4000:]
    q = json.loads(res.stdout.strip().splitlines()[-1])
    print("\nlegacy backends on held-out text:", json.dumps(q, indent=1))
    for name, r in q.items():
        assert r["generated"].strip(), (name, r)
        if not name.startswith("rtn"):  # a quantized kernel module, not weights dequantized into nn.Linear
            assert r["layer0_down_proj"] != "Linear", (name, r)
        assert 0 < r["kl"] < 0.5 and r["top1"] > 0.9, (name, r)
    assert q["gptq-legacy"]["kl"] < q["rtn"]["kl"], q  # GPTQ W4 sym g128 vs RTN of the same scheme
    # Measured, not wished: AutoAWQ 0.2.9 does NOT beat RTN of its scheme (W4 asym g128) on this tiny model
    # (KL ~2.3e-3 vs ~5.7e-4; its own unpacking gives the same figure, so it is the quantizer, not the
    # loader; without its clipping step it is worse still), while llm-compressor's AWQ does
    # (test_quantize). So only a sanity bound here; docs/BENCHMARKS.md records the figures.
    assert q["awq-legacy"]["kl"] < 10 * q["rtn-asym"]["kl"] and q["awq-legacy"]["top1"] > 0.95, q
