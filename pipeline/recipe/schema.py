"""The recipe's schema: pydantic v2 models, strict (unknown keys are errors), with the defaults a user would pick.
Checked from the recipe alone; what needs the files it names (their rows, the model's config.json, lm-eval's task
index) is checked by `quantpipe.inputs`. Methods: `methods.py`; the benchmark section: `benchmark.py`; path fields'
types: `paths.py`. `quantpipe schema` prints the JSON schema:

    from quantpipe.recipe import Recipe
    Recipe.model_validate({"name": "t", "output_dir": "out", "base": {"model": "m"}, "artifacts": [{"name": "f", "method": "fp8"}]})
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from .benchmark import Benchmark, _repeated
from .methods import NAME, Artifact, Strict
from .paths import AdapterDir, LocalDir, LocalFile, LocalPathMarker, ModelDir, Place, is_local

# --- model and adapters -----------------------------------------------------------------------


class Base(Strict):
    model: ModelDir = Field(description="Local model directory, or a hub id (org/name) where a network is available.")
    revision: str | None = Field(None, description="Hub revision (hub ids only).")
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    trust_remote_code: bool = Field(
        False, description="Run modelling code shipped with the model. Off unless you trust it."
    )
    allow_pickle: bool = Field(False, description="Accept pickle (.bin) weights. Off: only safetensors load.")

    @property
    def is_local(self) -> bool:
        return is_local(self.model)


class Adapter(Strict):
    path: AdapterDir = Field(description="LoRA adapter directory (adapter_config.json + adapter_model.safetensors).")
    weight: float = Field(1.0, gt=0, le=10, description="Scale applied to this adapter when merging.")


# --- calibration ------------------------------------------------------------------------------


CalibrationFile = Annotated[str, LocalPathMarker(is_dir=False, suffixes=(".jsonl", ".json", ".parquet"))]


class CalibrationSource(Strict):
    path: CalibrationFile | None = Field(
        None, description="Local .jsonl, .json or .parquet file with a `text` field or chat `messages`."
    )
    dataset: str | None = Field(None, description="Hub dataset id (needs a network).")
    split: str = "train"
    column: str | None = Field(None, description="Field holding the text (default: `text`, or `messages` for chat).")
    weight: float = Field(1.0, gt=0, description="Share of the samples drawn from this source.")

    @model_validator(mode="after")
    def _one_source(self):
        if (self.path is None) == (self.dataset is None):
            raise ValueError("give exactly one of `path` (a local file) or `dataset` (a hub dataset id)")
        return self


class Calibration(Strict):
    sources: list[CalibrationSource] = Field(min_length=1)
    num_samples: int = Field(128, ge=1, le=100_000)
    max_seq_len: int = Field(512, ge=8, le=131_072)
    seed: int = 0
    shuffle: bool = True
    chat_template: Literal["auto", "always", "never"] = Field(
        "auto", description="Apply the model's chat template to `messages` rows (auto: when the row has messages)."
    )


# --- evaluation -------------------------------------------------------------------------------


class LmEval(Strict):
    tasks: list[str] = Field(min_length=1)
    include_path: LocalDir | None = Field(None, description="Folder of local task YAMLs (offline tasks).")
    trust_task_code: bool = Field(
        False,
        description="Let include_path's task YAMLs run Python (`!function`, `class:`). Off unless you trust the folder.",
    )
    num_fewshot: int | None = Field(None, ge=0, le=64)
    limit: int | None = Field(None, ge=1, description="Examples per task (None: all).")
    batch_size: int = Field(8, ge=1)
    apply_chat_template: bool = False
    seed: int = 1234
    backend: Literal["auto", "hf", "vllm"] = "auto"
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="vllm backend on a GPU: the share of GPU memory an evaluation's own server reserves (None: vLLM's 0.9); "
        "an evaluation answered by the benchmark's server uses benchmark.engine's. Lower it to share the GPU.",
    )

    @field_validator("tasks")
    @classmethod
    def _once_each(cls, v: list[str]) -> list[str]:
        if _repeated(v):
            raise ValueError(f"{', '.join(_repeated(v))} listed more than once; list each task once")
        return v

    @model_validator(mode="after")
    def _gpu_share_needs_vllm(self):
        if self.gpu_memory_utilization is not None and self.backend == "hf":
            raise ValueError(
                "gpu_memory_utilization applies to the vllm backend only; remove it, or set backend: vllm (or auto)"
            )
        return self


class Validation(Strict):
    path: LocalFile = Field(description="JSONL with `prompt` (or chat `messages`) and `reference` per row.")
    metric: Literal["exact_match", "contains", "regex", "json_valid"] = "exact_match"
    max_new_tokens: int = Field(32, ge=1, le=4096)
    stop: list[str] = Field(
        default_factory=list, description='Cut each output at the first of these strings (e.g. ["\\n"]) before scoring.'
    )
    json_schema: LocalFile | None = Field(
        None, description="JSON schema file the output must match (metric json_valid)."
    )


HeldoutFile = Annotated[
    str,
    LocalPathMarker(is_dir=False, hint='point it at a JSONL file of held-out documents, one {"text": ...} per line'),
]


class Fidelity(Strict):
    path: HeldoutFile = Field(
        description='JSONL of held-out documents, one `{"text": ...}` per line, on which the artifact\'s next-token '
        "distributions are compared with the baseline's (KL, top-1 agreement, perplexity)."
    )
    max_tokens: int = Field(
        20_000,
        ge=32,
        le=10_000_000,
        description=(
            "Token budget: the documents are tokenized (BOS by the tokenizer's rule), concatenated and cut into windows of "
            "`seq_len` tokens until this many tokens are taken; a shorter text gives fewer windows."
        ),
    )
    seq_len: int = Field(
        256,
        ge=16,
        le=131_072,
        description=(
            "Tokens per window. Every position after a window's first is scored; the 95% intervals resample windows, "
            "not tokens, because tokens within a window are correlated."
        ),
    )

    @model_validator(mode="after")
    def _two_windows(self):
        if self.max_tokens < 2 * self.seq_len:
            raise ValueError(
                f"max_tokens {self.max_tokens} holds fewer than two windows of seq_len {self.seq_len} (the intervals "
                f"resample windows); raise max_tokens to at least {2 * self.seq_len} or lower seq_len"
            )
        return self


class Gates(Strict):
    """Each gate is checked on the 95% interval's bound, not the estimate: an artifact passes only when the interval lies
    on the right side of the gate (where a figure has no interval, its estimate is compared and the failure says so)."""

    min_recovery: float | None = Field(
        None,
        gt=0,
        le=2,
        description=(
            "Every task metric: artifact/baseline at least this, checked on the lower bound of the recovery's paired-bootstrap 95% CI."
        ),
    )
    min_recovery_per_task: dict[str, Annotated[float, Field(gt=0, le=2)]] = Field(
        default_factory=dict,
        description=(
            "Per task (lm-eval task name, or `validation`): replaces min_recovery for that task; checked on the lower bound as well."
        ),
    )
    max_kl: float | None = Field(
        None,
        ge=0,
        description=(
            "Mean next-token KL divergence vs the baseline at most this, checked on the upper bound of its 95% interval "
            "(bootstrap over windows). Needs evaluation.fidelity or evaluation.validation."
        ),
    )
    min_top1_agreement: float | None = Field(
        None,
        ge=0,
        le=1,
        description=(
            "Share of positions where the artifact's top token is the baseline's, at least this, checked on the lower bound of "
            "its 95% interval. Needs evaluation.fidelity or evaluation.validation."
        ),
    )


class Evaluation(Strict):
    lm_eval: LmEval | None = None
    validation: Validation | None = None
    fidelity: Fidelity | None = Field(
        None,
        description=(
            "Held-out documents for the fidelity figures (KL, top-1 agreement, perplexity vs the baseline). Unset: they are "
            "measured on the reference tokens of the validation rows."
        ),
    )
    add_bos: bool | None = Field(
        None,
        description="Prepend BOS to raw-text prompts (lm-eval, validation, fidelity). None: the tokenizer's own rule, as vLLM and lm-eval do.",
    )
    gates: Gates = Gates()
    bootstrap_samples: int = Field(
        1000,
        ge=100,
        le=100_000,
        description=(
            "Resamples of every 95% interval of the evaluate stage (fixed seed): recovery, paired over examples; fidelity, over "
            "windows (validation rows without evaluation.fidelity)."
        ),
    )

    @model_validator(mode="after")
    def _gates_can_be_checked(self):
        # A gate with nothing to measure would fail every artifact after the whole run (quantpipe.common.gates): say so now.
        g = self.gates
        if self.validation is None and self.fidelity is None:
            for key in ("max_kl", "min_top1_agreement"):
                if getattr(g, key) is not None:
                    raise ValueError(
                        f"gates.{key} compares next-token distributions with the baseline's: add evaluation.validation "
                        "(scored on its references) or evaluation.fidelity (held-out documents), or remove the gate"
                    )
        if self.lm_eval is None and self.validation is None and (g.min_recovery is not None or g.min_recovery_per_task):
            raise ValueError(
                "gates.min_recovery needs something evaluated: add evaluation.lm_eval or evaluation.validation, or remove the gate"
            )
        if self.lm_eval is None:
            stray = sorted(set(g.min_recovery_per_task) - {"validation"})
            if stray:
                raise ValueError(
                    f"gates.min_recovery_per_task names {', '.join(map(repr, stray))}, but no lm_eval task runs "
                    "(without evaluation.lm_eval the only task is 'validation'); fix the name or add the task"
                )
        return self


# --- packaging --------------------------------------------------------------------------------


class Package(Strict):
    enabled: bool = True
    max_shard_size: str = Field("5GB", pattern=r"^\d+(\.\d+)?\s*(B|KB|MB|GB|KiB|MiB|GiB)$")
    license: str | None = Field(None, description="Default: carried from the base model's card.")


# --- tracking ---------------------------------------------------------------------------------


class MlflowTracking(Strict):
    uri: str = Field(
        min_length=1,
        description="Tracking server, e.g. http://mlflow.internal:5000 (credentials go in MLFLOW_TRACKING_TOKEN or "
        "MLFLOW_TRACKING_USERNAME/PASSWORD, never in the URI). `run --mlflow URI` overrides it.",
    )
    experiment: str | None = Field(
        None, min_length=1, description="Experiment to log runs to (default: the recipe's name)."
    )

    @field_validator("uri")
    @classmethod
    def _no_credentials(cls, v: str) -> str:
        if re.match(r"^[a-z][a-z0-9+.-]*://[^/@]+@", v, re.I):
            raise ValueError(
                "the MLflow URI carries credentials, which would be written to run.json; put them in "
                "MLFLOW_TRACKING_TOKEN or MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD instead"
            )
        return v


class Tracking(Strict):
    mlflow: MlflowTracking | None = Field(
        None,
        description="Log each run to MLflow and register its packages as model versions; "
        "the run's own files stay the record, and a run still succeeds when the server is down.",
    )


# --- the recipe -------------------------------------------------------------------------------


class Recipe(Strict):
    name: str = Field(description="Name of this build; used in run ids and reports.")
    notes: str | None = Field(
        None,
        min_length=1,
        max_length=2000,
        description="Shown at the top of the report and of each package's model card: what a reader must know about this build (e.g. that the weights are random, so accuracy figures mean nothing).",
    )
    output_dir: Place = Field(description="Where runs, packages and reports go (relative to the recipe file).")
    cache_dir: Place | None = Field(None, description="Stage cache (default: $QUANTPIPE_CACHE or ~/.cache/quantpipe).")
    base: Base
    adapters: list[Adapter] = Field(default_factory=list)
    calibration: Calibration | None = None
    artifacts: list[Artifact] = Field(min_length=1)
    evaluation: Evaluation = Evaluation()
    benchmark: Benchmark = Benchmark()
    package: Package = Package()
    tracking: Tracking = Tracking()

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        if not NAME.match(v):
            raise ValueError(f"recipe name {v!r} must be 1-64 of a-z, 0-9, '-', '_', '.'")
        return v

    @model_validator(mode="after")
    def _consistent(self):
        names = [a.name for a in self.artifacts]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"artifact names must be unique; repeated: {', '.join(sorted(dup))}")
        if "baseline" in names:
            raise ValueError("'baseline' is reserved for the unquantized merged model; rename that artifact")
        needs_cal = [
            a.name for a in self.artifacts if not (a.method == "fp8" and a.mode != "static") and a.method != "rtn"
        ]
        if needs_cal and self.calibration is None:
            raise ValueError(f"artifacts {', '.join(needs_cal)} need calibration data: add a `calibration:` section")
        if self.benchmark.enabled and self.evaluation.validation is None:
            bad = [w.name for w in self.benchmark.workloads if w.kind == "validation"]
            if bad:
                raise ValueError(
                    f"workload {bad[0]!r} has kind validation, which sends the validation set's prompts, but "
                    "evaluation.validation is not set; add it, or use kind fixed"
                )
        return self
