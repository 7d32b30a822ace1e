"""The recipe: one strict schema for everything `quantpipe run` does.

A recipe is YAML read with `yaml.safe_load`, validated by the pydantic v2 models below (unknown keys
are errors), with relative paths resolved against the recipe file's folder. `quantpipe schema`
prints the JSON schema; `quantpipe check RECIPE` validates without running anything:

    quantpipe check recipes/demo.yaml
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
MAX_RECIPE_BYTES = 1 << 20


class RecipeError(Exception):
    """A recipe that cannot be used; the message names the field and the fix."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --- model and adapters -----------------------------------------------------------------------


class Base(Strict):
    model: str = Field(description="Local model directory, or a hub id (org/name) where a network is available.")
    revision: str | None = Field(None, description="Hub revision (hub ids only).")
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    trust_remote_code: bool = Field(False, description="Run modelling code shipped with the model. Off unless you trust it.")
    allow_pickle: bool = Field(False, description="Accept pickle (.bin) weights. Off: only safetensors load.")

    @property
    def is_local(self) -> bool:
        return Path(self.model).exists() or not HUB_ID.match(self.model)


class Adapter(Strict):
    path: str = Field(description="LoRA adapter directory (adapter_config.json + adapter_model.safetensors).")
    weight: float = Field(1.0, gt=0, le=10, description="Scale applied to this adapter when merging.")


# --- calibration ------------------------------------------------------------------------------


class CalibrationSource(Strict):
    path: str | None = Field(None, description="Local .jsonl, .json or .parquet file with a `text` field or chat `messages`.")
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


# --- artifacts (discriminated on `method`) --------------------------------------------------------


class _Artifact(Strict):
    name: str = Field(description="Short name: lowercase letters, digits, '-', '_' or '.'; used in paths.")
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"], description="Modules left unquantized.")
    targets: list[str] = Field(default_factory=lambda: ["Linear"])
    sequential_targets: list[str] | None = Field(None, description="Decoder-layer class names onloaded one at a time.")
    pipeline: Literal["independent", "sequential", "basic", "datafree"] | None = Field(
        None, description="llm-compressor calibration pipeline; default: its own choice."
    )

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        if not NAME.match(v):
            raise ValueError(
                f"artifact name {v!r} must be 1-64 of a-z, 0-9, '-', '_', '.', starting with a letter or digit "
                "(it becomes a directory name)"
            )
        return v


def _legacy_options(a: _Artifact, backend: str) -> None:
    """Options of the llm-compressor path that a legacy backend cannot honour are refused, not ignored."""
    if list(a.targets) != ["Linear"]:
        raise ValueError(f"backend {backend} quantizes the Linear layers of the decoder blocks only: remove `targets` or use backend: llm-compressor")
    if "lm_head" not in a.ignore:
        raise ValueError(f"backend {backend} cannot quantize lm_head: keep lm_head in `ignore` or use backend: llm-compressor")
    if any(i.startswith("re:") for i in a.ignore) and backend == "autoawq":
        raise ValueError("backend autoawq skips modules by name (substring), not by `re:` pattern: list the names in `ignore`")
    for key in ("pipeline", "sequential_targets"):
        if getattr(a, key) is not None:
            raise ValueError(f"`{key}` is an llm-compressor option; backend {backend} has none: remove it or use backend: llm-compressor")


class AWQ(_Artifact):
    method: Literal["awq"]
    symmetric: bool = Field(False, description="W4A16 (symmetric) or W4A16_ASYM (asymmetric, AWQ's usual choice).")
    group_size: Literal[32, 64, 128, 256] = 128
    duo_scaling: bool = True
    n_grid: int = Field(20, ge=1, le=100, description="Grid points searched per smoothing scale.")
    backend: Literal["llm-compressor", "autoawq"] = Field(
        "llm-compressor", description="autoawq: legacy AutoAWQ GEMM checkpoint, in its own environment (`make setup-legacy`)."
    )

    @model_validator(mode="after")
    def _autoawq_options(self):
        if self.backend == "autoawq":
            _legacy_options(self, "autoawq")
            if self.symmetric:
                raise ValueError("backend autoawq writes the GEMM format, which needs zero points: remove `symmetric: true` or use backend: llm-compressor")
            if self.n_grid != 20:
                raise ValueError(f"backend autoawq searches a fixed grid of 20 points: remove `n_grid: {self.n_grid}` or use backend: llm-compressor")
        return self


class GPTQ(_Artifact):
    method: Literal["gptq"]
    bits: Literal[4, 8] = 4
    group_size: Literal[32, 64, 128, 256] | None = 128
    actorder: Literal["static", "group", "weight"] | None = "static"
    dampening_frac: float = Field(0.01, gt=0, lt=1)
    block_size: int = Field(128, ge=1)
    backend: Literal["llm-compressor", "gptqmodel", "auto-gptq"] = Field(
        "llm-compressor", description="gptqmodel: GPTQModel's GPTQ checkpoint, in its own environment (`make setup-legacy`)."
    )

    @field_validator("backend")
    @classmethod
    def _no_auto_gptq(cls, v: str) -> str:
        if v == "auto-gptq":
            raise ValueError(
                "auto-gptq is unmaintained and cannot import under transformers 5 (no_init_weights); "
                "use backend: llm-compressor (default) or backend: gptqmodel, its successor"
            )
        return v

    @model_validator(mode="after")
    def _gptqmodel_options(self):
        if self.backend == "gptqmodel":
            _legacy_options(self, "gptqmodel")
            if self.block_size != 128:
                raise ValueError(f"backend gptqmodel works in fixed blocks of 128 columns: remove `block_size: {self.block_size}` or use backend: llm-compressor")
        return self


class FP8(_Artifact):
    method: Literal["fp8"]
    mode: Literal["dynamic", "static", "block"] = Field(
        "dynamic", description="dynamic: FP8_DYNAMIC (no calibration); static: calibrated per-tensor activations; block: FP8_BLOCK."
    )


class W8A8Int8(_Artifact):
    method: Literal["w8a8-int8"]
    smoothing_strength: float = Field(0.8, ge=0, le=1)
    dampening_frac: float = Field(0.01, gt=0, lt=1)


class RTN(_Artifact):
    """Round-to-nearest weight-only quantization: the uncalibrated reference the others must beat."""

    method: Literal["rtn"]
    bits: Literal[4, 8] = 4
    group_size: Literal[32, 64, 128, 256] = 128
    symmetric: bool = Field(True, description="Symmetric (W4A16) or with zero points (W4A16_ASYM: the like-for-like reference for AWQ's default).")


Artifact = Annotated[Union[AWQ, GPTQ, FP8, W8A8Int8, RTN], Field(discriminator="method")]
METHODS = ("awq", "gptq", "fp8", "w8a8-int8", "rtn")


# --- evaluation -------------------------------------------------------------------------------


class LmEval(Strict):
    tasks: list[str] = Field(min_length=1)
    include_path: str | None = Field(None, description="Folder of local task YAMLs (offline tasks).")
    num_fewshot: int | None = Field(None, ge=0, le=64)
    limit: int | None = Field(None, ge=1, description="Examples per task (None: all).")
    batch_size: int = Field(8, ge=1)
    apply_chat_template: bool = False
    seed: int = 1234
    backend: Literal["auto", "hf", "vllm"] = "auto"
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="vllm backend on a GPU: the share of GPU memory its engine reserves (None: vLLM's 0.9). Lower it to share the GPU.")

    @model_validator(mode="after")
    def _gpu_share_needs_vllm(self):
        if self.gpu_memory_utilization is not None and self.backend == "hf":
            raise ValueError("gpu_memory_utilization applies to the vllm backend only; remove it, or set backend: vllm (or auto)")
        return self


class Validation(Strict):
    path: str = Field(description="JSONL with `prompt` (or chat `messages`) and `reference` per row.")
    metric: Literal["exact_match", "contains", "regex", "json_valid"] = "exact_match"
    max_new_tokens: int = Field(32, ge=1, le=4096)
    stop: list[str] = Field(default_factory=list, description="Cut each output at the first of these strings (e.g. [\"\\n\"]) before scoring.")
    json_schema: str | None = Field(None, description="JSON schema file the output must match (metric json_valid).")


class Gates(Strict):
    min_recovery: float | None = Field(None, gt=0, le=2, description="Every task metric: artifact/baseline at least this.")
    min_recovery_per_task: dict[str, float] = Field(default_factory=dict)
    max_kl: float | None = Field(None, ge=0, description="Mean next-token KL divergence vs the baseline at most this.")
    min_top1_agreement: float | None = Field(None, ge=0, le=1)


class Evaluation(Strict):
    lm_eval: LmEval | None = None
    validation: Validation | None = None
    add_bos: bool | None = Field(
        None, description="Prepend BOS to raw-text prompts (lm-eval, validation, fidelity). None: the tokenizer's own rule, as vLLM and lm-eval do."
    )
    gates: Gates = Gates()
    bootstrap_samples: int = Field(1000, ge=100, le=100_000)


# --- benchmark --------------------------------------------------------------------------------


class Engine(Strict):
    max_model_len: int | None = Field(None, ge=16)
    max_num_seqs: int | None = Field(None, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=16)
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    enable_prefix_caching: bool | None = None
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] | None = None
    tensor_parallel_size: int | None = Field(None, ge=1)
    enforce_eager: bool | None = None
    kv_cache_memory_bytes: int | None = Field(None, ge=1 << 20, description="CPU backend: KV-cache size.")
    extra_args: list[str] = Field(default_factory=list, description="Further `vllm serve` flags, passed as given.")

    @field_validator("extra_args")
    @classmethod
    def _no_quantization_flag(cls, v: list[str]) -> list[str]:
        for a in v:
            if a.split("=")[0] in ("--quantization", "-q", "--host"):
                raise ValueError(f"{a.split('=')[0]} is set by quantpipe (vLLM detects quantization from the artifact)")
        return v


class Variant(Strict):
    name: str
    engine: Engine


class Workload(Strict):
    name: str
    kind: Literal["fixed", "validation", "shared_prefix"] = "fixed"
    input_len: int = Field(128, ge=1)
    output_len: int = Field(64, ge=1)
    prefix_len: int = Field(0, ge=0, description="shared_prefix: tokens of common system prompt.")
    num_prompts: int = Field(32, ge=1, le=100_000)


class SLO(Strict):
    ttft_p99_ms: float | None = Field(None, gt=0)
    tpot_p99_ms: float | None = Field(None, gt=0)
    e2el_p99_ms: float | None = Field(None, gt=0)


class Benchmark(Strict):
    enabled: bool = True
    engine: Engine = Engine()
    variants: list[Variant] = Field(default_factory=list, description="Engine-argument variants measured beside `engine`.")
    workloads: list[Workload] = Field(default_factory=lambda: [Workload(name="fixed")])
    concurrency: list[int] = Field(default_factory=lambda: [1, 4, 16])
    slo: SLO = SLO()
    offline: bool = Field(True, description="Also measure offline batch-1 latency and throughput.")
    lora: bool = Field(True, description="With adapters: also serve base + adapter at request time.")
    seed: int = 0

    @field_validator("concurrency")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if not v or any(c < 1 for c in v):
            raise ValueError("concurrency must be a non-empty list of positive integers, e.g. [1, 4, 16]")
        return sorted(set(v))


# --- packaging --------------------------------------------------------------------------------


class Package(Strict):
    enabled: bool = True
    max_shard_size: str = Field("5GB", pattern=r"^\d+(\.\d+)?\s*(B|KB|MB|GB|KiB|MiB|GiB)$")
    license: str | None = Field(None, description="Default: carried from the base model's card.")


# --- the recipe -------------------------------------------------------------------------------


class Recipe(Strict):
    name: str = Field(description="Name of this build; used in run ids and reports.")
    notes: str | None = Field(None, min_length=1, max_length=2000, description="Shown at the top of the report and of each package's model card: what a reader must know about this build (e.g. that the weights are random, so accuracy figures mean nothing).")
    output_dir: str = Field(description="Where runs, packages and reports go (relative to the recipe file).")
    cache_dir: str | None = Field(None, description="Stage cache (default: $QUANTPIPE_CACHE or ~/.cache/quantpipe).")
    base: Base
    adapters: list[Adapter] = Field(default_factory=list)
    calibration: Calibration | None = None
    artifacts: list[Artifact] = Field(min_length=1)
    evaluation: Evaluation = Evaluation()
    benchmark: Benchmark = Benchmark()
    package: Package = Package()

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
        needs_cal = [a.name for a in self.artifacts if not (a.method == "fp8" and a.mode != "static") and a.method != "rtn"]
        if needs_cal and self.calibration is None:
            raise ValueError(f"artifacts {', '.join(needs_cal)} need calibration data: add a `calibration:` section")
        return self


def _format_error(err: ValidationError, source: str) -> str:
    lines = [f"{source}: {err.error_count()} problem(s) in the recipe:"]
    for e in err.errors():
        parts = list(e["loc"])
        if len(parts) > 2 and parts[0] == "artifacts" and parts[2] in METHODS_TAGS:
            del parts[2]  # the union's tag (artifacts.0.awq.group_size): not a key the user wrote
        loc = ".".join(str(p) for p in parts)
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key; remove it or fix its spelling (`quantpipe schema` lists the keys)"
        elif e["type"] == "union_tag_invalid":
            msg = f"unknown method {e['input'].get('method')!r}; use one of: {', '.join(METHODS)}" if isinstance(e.get("input"), dict) else msg
        elif e["type"] == "union_tag_not_found":
            msg = f"missing `method`; use one of: {', '.join(METHODS)}"
        lines.append(f"  - {loc or '(top level)'}: {msg}")
    return "\n".join(lines)


METHODS_TAGS = set(METHODS)


def _resolve_paths(data: dict, root: Path) -> dict:
    """Make the recipe's local paths absolute (relative to the recipe file's folder)."""

    def fix(p: str | None, field: str) -> str | None:
        if p is None:
            return None
        try:
            q = Path(p).expanduser()
        except RuntimeError:  # ~user of a user that does not exist: a relative path like any other
            q = Path(p)
        if len(os.fsencode(root / q)) > 4095 or any(len(os.fsencode(c)) > 255 for c in q.parts):
            raise RecipeError(f"{field}: {p[:60]!r}... is longer than a file path can be; fix the path")
        if q.is_absolute():
            return str(q)
        try:
            return str((root / q).resolve())
        except (OSError, RuntimeError, ValueError):  # a symlink loop, a NUL byte: the file checks report it missing
            return os.path.abspath(root / q)

    def listed(v) -> list:
        return v if isinstance(v, list) else []  # anything else is the schema's to refuse

    base = data.get("base")
    if isinstance(base, dict) and isinstance(base.get("model"), str):
        m = base["model"]
        if m.startswith((".", "/", "~")) or _exists(root / m) or not HUB_ID.match(m):
            base["model"] = fix(m, "base.model")
    for i, a in enumerate(listed(data.get("adapters"))):
        if isinstance(a, dict) and isinstance(a.get("path"), str):
            a["path"] = fix(a["path"], f"adapters.{i}.path")
    cal = data.get("calibration")
    if isinstance(cal, dict):
        for i, s in enumerate(listed(cal.get("sources"))):
            if isinstance(s, dict) and isinstance(s.get("path"), str):
                s["path"] = fix(s["path"], f"calibration.sources.{i}.path")
    ev = data.get("evaluation")
    if isinstance(ev, dict):
        if isinstance(ev.get("lm_eval"), dict) and isinstance(ev["lm_eval"].get("include_path"), str):
            ev["lm_eval"]["include_path"] = fix(ev["lm_eval"]["include_path"], "evaluation.lm_eval.include_path")
        val = ev.get("validation")
        if isinstance(val, dict):
            for k in ("path", "json_schema"):
                if isinstance(val.get(k), str):
                    val[k] = fix(val[k], f"evaluation.validation.{k}")
    for k in ("output_dir", "cache_dir"):
        if isinstance(data.get(k), str):
            data[k] = fix(data[k], k)
    return data


def _exists(p: Path) -> bool:
    try:
        return p.exists()
    except OSError:  # a name too long for the file system...
        return False


def _check_files(r: Recipe) -> list[str]:
    """Problems with the files a recipe points at, found before anything runs."""
    problems = []
    if r.base.is_local:
        p = Path(r.base.model)
        if not p.is_dir():
            problems.append(f"base.model: {p} is not a directory; give a local model directory or a hub id (org/name)")
        elif not (p / "config.json").is_file():
            problems.append(f"base.model: {p} has no config.json; point it at a Hugging Face model directory")
        else:
            has_st = any(p.glob("*.safetensors"))
            has_bin = any(p.glob("*.bin")) or any(p.glob("*.pt"))
            if not has_st and has_bin and not r.base.allow_pickle:
                problems.append(
                    f"base.model: {p} has only pickle (.bin) weights, which can run code when loaded; convert them to "
                    "safetensors or set base.allow_pickle: true if you trust the files"
                )
            elif not has_st and not has_bin:
                problems.append(f"base.model: {p} holds no weights (*.safetensors)")
    for i, a in enumerate(r.adapters):
        p = Path(a.path)
        if not p.is_dir():
            problems.append(f"adapters.{i}.path: {p} is not a directory")
        elif not (p / "adapter_config.json").is_file():
            problems.append(f"adapters.{i}.path: {p} is not a LoRA adapter (no adapter_config.json)")
        elif not (p / "adapter_model.safetensors").is_file():
            if (p / "adapter_model.bin").is_file() and not r.base.allow_pickle:
                problems.append(
                    f"adapters.{i}.path: {p} has only a pickle adapter_model.bin; convert it to safetensors "
                    "or set base.allow_pickle: true if you trust it"
                )
            elif not (p / "adapter_model.bin").is_file():
                problems.append(f"adapters.{i}.path: {p} has no adapter_model.safetensors")
    if r.calibration:
        for i, s in enumerate(r.calibration.sources):
            if s.path and not Path(s.path).is_file():
                problems.append(f"calibration.sources.{i}.path: {s.path} does not exist")
            elif s.path and not s.path.endswith((".jsonl", ".json", ".parquet")):
                problems.append(f"calibration.sources.{i}.path: {s.path} must be .jsonl, .json or .parquet")
    ev = r.evaluation
    if ev.lm_eval and ev.lm_eval.include_path and not Path(ev.lm_eval.include_path).is_dir():
        problems.append(f"evaluation.lm_eval.include_path: {ev.lm_eval.include_path} is not a directory")
    if ev.validation:
        if not Path(ev.validation.path).is_file():
            problems.append(f"evaluation.validation.path: {ev.validation.path} does not exist")
        if ev.validation.json_schema and not Path(ev.validation.json_schema).is_file():
            problems.append(f"evaluation.validation.json_schema: {ev.validation.json_schema} does not exist")
    return problems


def parse(text: str, root: Path, source: str = "recipe", check_files: bool = True) -> Recipe:
    """Validate recipe text; raise RecipeError with every problem listed."""
    if len(text.encode("utf-8", "replace")) > MAX_RECIPE_BYTES:
        raise RecipeError(f"{source}: larger than 1 MiB; a recipe is a short YAML file")
    try:
        # safe_load only: no Python objects; the size cap above bounds alias bombs' input,
        # and the composed document is checked below before anything expands further.
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise RecipeError(f"{source}: not valid YAML{where}: {getattr(e, 'problem', None) or e}. Fix the syntax there.") from None
    except RecursionError:
        raise RecipeError(f"{source}: YAML nested too deeply") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{source}: a recipe is a YAML mapping (key: value lines), got {type(data).__name__}")
    _check_size(data, source)
    try:
        data = _resolve_paths(data, root)
    except RecipeError as e:
        raise RecipeError(f"{source}: {e}") from None
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError(_format_error(e, source)) from None
    try:
        problems = _check_files(recipe) if check_files else []
    except OSError as e:  # a path the file system refuses (too long, no permission to look): name it
        raise RecipeError(f"{source}: cannot check a path it names: {e.strerror or e}: {e.filename!r}; fix that path") from None
    if problems:
        raise RecipeError(f"{source}: {len(problems)} problem(s) with the files it names:\n" + "\n".join(f"  - {p}" for p in problems))
    return recipe


def _check_size(data: Any, source: str, limit: int = 100_000) -> None:
    """Refuse documents that expand (YAML aliases) into more nodes than any sane recipe has."""
    seen, stack = 0, [data]
    while stack:
        node = stack.pop()
        seen += 1
        if seen > limit:
            raise RecipeError(f"{source}: the YAML expands to over {limit} values (an alias bomb?); write the recipe out plainly")
        if isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def load(path: str | Path, check_files: bool = True) -> Recipe:
    """Read and validate a recipe file."""
    p = Path(path)
    if not p.is_file():
        raise RecipeError(f"{path}: no such recipe file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise RecipeError(f"{path}: not a text file; a recipe is UTF-8 YAML") from None
    except OSError as e:
        raise RecipeError(f"{path}: cannot read it ({e.strerror})") from None
    return parse(text, p.resolve().parent, source=str(path), check_files=check_files)


def json_schema() -> dict:
    return Recipe.model_json_schema()
