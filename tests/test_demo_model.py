"""The demo's real model (SmolLM2-135M-Instruct, scripts/build_smollm2.py) through quantize and evaluate.

Two claims the demo rests on, checked on the real model rather than the tiny one:
- calibration pays: GPTQ and AWQ are closer to the baseline (mean next-token KL) than round-to-nearest
  at the same bits and group size (GPTQ against symmetric RTN, AWQ against RTN with zero points, as AWQ);
- the adapter matters: the merged model's validation exact match differs from the base model's by more
  than the paired 95% interval of the difference.
The recipe is recipes/demo.yaml reduced to these artifacts, its validation set and half its fidelity text, run with
`quantpipe run --stages quantize,evaluate` in a fresh stage cache. Slow (the `smollm2` fixture builds the model once, cached):

    .venv/quantize/bin/python -m pytest -q tests/test_demo_model.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def _recipe(smollm2, tmp_path: Path, name: str, adapter: bool, artifacts: list[dict]) -> Path:
    """recipes/demo.yaml pointed at the build, with these artifacts; no lm-eval task (validation and fidelity
    are what the test reads), no benchmark, no package."""
    r = yaml.safe_load((REPO / "recipes" / "demo.yaml").read_text())
    r.update(name=name, output_dir=str(tmp_path / name / "out"), artifacts=artifacts)
    r["base"]["model"] = str(smollm2.model)
    r["adapters"] = [{"path": str(smollm2.lora)}] if adapter else []
    r["calibration"]["sources"] = [{"path": str(smollm2.calibration)}]
    del r["evaluation"]["lm_eval"]
    r["evaluation"]["validation"]["path"] = str(smollm2.validation)
    r["evaluation"]["fidelity"]["path"] = str(smollm2.fidelity)
    r["evaluation"]["fidelity"]["max_tokens"] = 4096  # half the demo's: the KL gaps between methods are wide
    r["benchmark"] = {"enabled": False}
    r["package"] = {"enabled": False}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(r, sort_keys=False))
    return path


def _run(recipe: Path, tmp_path: Path, stages: str) -> dict:
    """`quantpipe run --stages ...` as a user runs it; the run record (run.json)."""
    proc = subprocess.run(
        [sys.executable, "-m", "quantpipe", "run", "-q", str(recipe), "--stages", stages],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=3600,
        env={**os.environ, "QUANTPIPE_CACHE": str(tmp_path / "cache")},
    )
    assert proc.returncode in (0, 3), (
        proc.stdout[-3000:] + proc.stderr[-6000:]
    )  # 3: a gate failed, the figures are there
    out = yaml.safe_load(recipe.read_text())["output_dir"]
    (run_json,) = Path(out).glob("runs/*/run.json")
    return json.loads(run_json.read_text())


def _evaluation(record: dict, stage: str) -> dict:
    return record["stages"][stage]["metrics"]


def test_calibrated_methods_beat_rtn_and_the_adapter_moves_validation(smollm2, tmp_path):
    demo = {a["name"]: a for a in yaml.safe_load((REPO / "recipes" / "demo.yaml").read_text())["artifacts"]}
    bits, group = demo["gptq"]["bits"], demo["gptq"]["group_size"]
    assert demo["awq"]["group_size"] == demo["rtn"]["group_size"] == group and demo["rtn"]["bits"] == bits
    artifacts = [
        demo["gptq"],
        demo["awq"],
        {**demo["rtn"], "symmetric": True},
        {**demo["rtn"], "name": "rtn-asym", "symmetric": False},
    ]
    merged = _run(_recipe(smollm2, tmp_path, "merged", True, artifacts), tmp_path, "quantize,evaluate")
    kl = {a["name"]: _evaluation(merged, f"evaluate:{a['name']}")["fidelity"]["kl_mean"] for a in artifacts}
    assert kl["gptq"] < kl["rtn"], kl
    assert kl["awq"] < kl["rtn-asym"], kl

    # The base model without the adapter (its one artifact, RTN, is the cheapest to build and evaluate).
    base = _run(_recipe(smollm2, tmp_path, "base", False, [demo["rtn"]]), tmp_path, "evaluate")
    key = "validation/exact_match"
    merged_rows = _per_example(merged, key)
    base_rows = _per_example(base, key)
    assert len(merged_rows) == len(base_rows) == smollm2.build["cities"]["validation"]
    diff, (lo, hi) = _paired_difference(merged_rows, base_rows)
    assert diff > 0 and lo > 0, (diff, lo, hi)  # the interval of the difference excludes 0


def _per_example(record: dict, key: str) -> list[float]:
    """The baseline's per-example scores of `key`, as evaluate:baseline kept them."""
    out = Path(record["stages"]["evaluate:baseline"]["out"])
    return json.loads((out / "per_example.json").read_text())["scores"][key]


def _paired_difference(a: list[float], b: list[float], samples: int = 2000) -> tuple[float, tuple[float, float]]:
    """mean(a) - mean(b) and its paired bootstrap 95% interval (the same examples drawn from both)."""
    import random

    rng = random.Random(0)
    n = len(a)
    draws = sorted(sum(a[i] - b[i] for i in (rng.randrange(n) for _ in range(n))) / n for _ in range(samples))
    return (sum(a) - sum(b)) / n, (draws[int(0.025 * samples)], draws[int(0.975 * samples) - 1])
