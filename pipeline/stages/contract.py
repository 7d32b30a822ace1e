"""The stage contract: each stage's typed input and the records of its upstream stages. A stage is
`run(inp, src, out, upstream) -> metrics`: `inp` is its slice of the recipe (the object whose hash, with every local path
replaced by its content hash, is the stage's cache key), `src` its input directory, `out` the directory it writes, and
`upstream` what the runner recorded for the other stages it reads (output directory, key, wall time, metrics), by role.
A stage never reads the recipe as a whole, the cache's layout or the runner's environment.

    from quantpipe.run.plan import stage_input
    inp = stage_input("quantize", recipe, "gptq-w4", base_dir)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ..recipe import (
    Adapter,
    Artifact,
    Base,
    Benchmark,
    Calibration,
    Fidelity,
    Gates,
    LmEval,
    Package,
    Strict,
    Validation,
)


class MergeInput(Strict):
    base: Base  # base.model is the local directory (a hub id is resolved by the runner first)
    adapters: list[Adapter] = []


class QuantizeInput(Strict):
    artifact: Artifact
    calibration: Calibration | None = None
    base: Base
    compute: str  # what its weights depend on beyond the recipe: "gpu", or "cpu DTYPE" (run.plan.compute_target)


class EvaluateInput(Strict):
    artifact: str  # "baseline" or the artifact's name
    method: str  # "none" for the baseline
    backend: Literal["hf", "vllm"]
    base: Base
    lm_eval: LmEval | None = None
    validation: Validation | None = None
    fidelity: Fidelity | None = None  # held-out documents; None: fidelity on the validation references
    add_bos: bool | None = None
    bootstrap_samples: int = 1000
    compute: str  # what its figures depend on beyond the recipe: "gpu", or "cpu DTYPE" (run.plan.compute_target)


class BenchmarkInput(Strict):
    artifact: str
    method: str
    served_model_name: str
    base: Base  # the unmerged base, served with `adapters` attached for the baseline's LoRA comparison
    adapters: list[Adapter] = []  # only for the baseline, when benchmark.lora is on
    benchmark: Benchmark
    validation: Validation | None = None  # workloads of kind `validation` send its prompts
    hardware: str  # what the figures depend on (envs.hardware_key)


class PackageInput(Strict):
    name: str  # the recipe's name
    notes: str | None = None
    artifact: Artifact
    base: Base
    adapters: list[Adapter] = []
    calibration: Calibration | None = None
    gates: Gates = Gates()
    benchmark: Benchmark
    package: Package


INPUTS = {
    "merge": MergeInput,
    "quantize": QuantizeInput,
    "evaluate": EvaluateInput,
    "benchmark": BenchmarkInput,
    "package": PackageInput,
}


@dataclass(frozen=True)
class Upstream:
    """What the runner recorded for a stage this one reads: its output directory, key, wall time and metrics."""

    out: Path
    stage: str
    key: str
    wall_s: float | None = None
    metrics: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "out": str(self.out),
            "stage": self.stage,
            "key": self.key,
            "wall_s": self.wall_s,
            "metrics": self.metrics,
        }

    @classmethod
    def from_json(cls, d: dict) -> "Upstream":
        return cls(
            out=Path(d["out"]), stage=d["stage"], key=d["key"], wall_s=d.get("wall_s"), metrics=d.get("metrics") or {}
        )
