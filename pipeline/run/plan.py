"""Planning a run: the stages of a recipe, each with its typed input and cache key. Pure: reads, writes nothing.

from quantpipe.run.plan import build_steps
steps = build_steps(recipe, base_dir)     # merge, evaluate:baseline, benchmark:baseline, quantize:x, ...
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..cache import hash_json
from ..common.compute import compute_dtype
from ..common.nvidia import visible_gpus
from ..envs import hardware_key, lock_hash, source_hash, stage_env
from ..recipe import Recipe, Strict, input_paths
from ..stages.contract import BenchmarkInput, EvaluateInput, MergeInput, PackageInput, QuantizeInput


def _artifact(recipe: Recipe, name: str):
    for a in recipe.artifacts:
        if a.name == name:
            return a
    raise KeyError(f"no artifact named {name!r} in the recipe; it has {', '.join(a.name for a in recipe.artifacts)}")


def lm_eval_backend(lm_eval) -> str:
    """The evaluation backend: the recipe's; for `auto`, vllm where a CUDA GPU is present, else hf."""
    if lm_eval is None or lm_eval.backend == "hf":
        return "hf"
    if lm_eval.backend == "vllm":
        return "vllm"
    return "vllm" if has_gpu() else "hf"


def compute_target(dtype: str) -> str:
    """What quantize's weights and evaluate's figures depend on beyond the recipe: "gpu" on a host with a CUDA GPU, else
    "cpu DTYPE" with the dtype a CPU computes a `dtype` model in (float32 where that half dtype has no fast kernels,
    common/compute.py). In the stage keys, so a cache shared by hosts that compute differently never mixes their results."""
    return "gpu" if has_gpu() else f"cpu {compute_dtype(dtype, 'cpu')}"


def has_gpu() -> bool:
    """The stages compute on a CUDA GPU: nvidia-smi lists one and CUDA_VISIBLE_DEVICES, where set, leaves one visible
    (set to "" or "-1" it hides them all, and the stages compute on the CPU)."""
    from ..envs import hardware

    return bool(hardware()["gpus"]) and visible_gpus() != []


def stage_input(kind: str, recipe: Recipe, artifact: str | None, base_dir: str, backend: str | None = None):
    """The typed input of one stage: what of the recipe it reads, with base.model the local base directory."""
    r = recipe
    base = r.base.model_copy(update={"model": str(base_dir)})
    if kind == "merge":
        return MergeInput(base=base, adapters=r.adapters)
    if kind == "quantize":
        return QuantizeInput(
            artifact=_artifact(r, artifact), calibration=r.calibration, base=base, compute=compute_target(base.dtype)
        )
    if kind == "evaluate":
        ev = r.evaluation
        method = "none" if artifact == "baseline" else _artifact(r, artifact).method
        backend = backend or lm_eval_backend(ev.lm_eval)
        return EvaluateInput(
            artifact=artifact,
            method=method,
            backend=backend,
            base=base,
            lm_eval=ev.lm_eval,
            validation=ev.validation,
            fidelity=ev.fidelity,
            add_bos=ev.add_bos,
            bootstrap_samples=ev.bootstrap_samples,
            compute=compute_target(base.dtype),
        )
    if kind == "benchmark":
        method = "none" if artifact == "baseline" else _artifact(r, artifact).method
        lora = artifact == "baseline" and r.benchmark.lora
        return BenchmarkInput(
            artifact=artifact,
            method=method,
            served_model_name=r.name,
            base=base,
            adapters=r.adapters if lora else [],
            benchmark=r.benchmark,
            validation=r.evaluation.validation,
            hardware=hardware_key(),
        )
    if kind == "package":  # the base as the recipe names it: the model card cites a hub id, not a local copy
        return PackageInput(
            name=r.name,
            notes=r.notes,
            artifact=_artifact(r, artifact),
            base=r.base,
            adapters=r.adapters,
            calibration=r.calibration,
            gates=r.evaluation.gates,
            benchmark=r.benchmark,
            package=r.package,
        )
    raise KeyError(f"unknown stage kind {kind!r}")


@dataclass
class Step:
    id: str
    kind: str
    artifact: str | None
    src: str  # step id of the input directory, or "external" (the base model)
    inp: Strict  # the stage's typed input (quantpipe.stages.contract)
    refs: dict[str, str] = field(default_factory=dict)  # role -> step id whose record the stage is handed
    env: str = ""  # the environment it runs in (envs.stage_env)
    key: str = ""
    joint: str = (
        ""  # an evaluate step under backend vllm: its benchmark step, whose server can answer it (runner: joint job)
    )


def build_steps(recipe: Recipe, base_dir: str) -> list[Step]:
    """The stages of a recipe, in the order they run, each with its input."""
    r = recipe
    ev = r.evaluation
    evaluate = ev.lm_eval is not None or ev.validation is not None or ev.fidelity is not None
    backend = lm_eval_backend(ev.lm_eval)  # auto: vllm where a CUDA GPU is present, else hf

    def step(sid, kind, artifact, src, refs=None, env_of=None):
        inp = stage_input(kind, r, artifact, base_dir, backend)
        env = "serve" if kind == "evaluate" and backend == "vllm" else stage_env(kind, env_of)
        return Step(sid, kind, artifact, src, inp, refs or {}, env)

    steps = [step("merge", "merge", None, "external")]
    if evaluate:
        steps.append(step("evaluate:baseline", "evaluate", "baseline", "merge"))
    if r.benchmark.enabled:
        steps.append(step("benchmark:baseline", "benchmark", "baseline", "merge"))
    for a in r.artifacts:
        q = f"quantize:{a.name}"
        steps.append(step(q, "quantize", a.name, "merge", env_of=a))
        if evaluate:
            steps.append(
                step(
                    f"evaluate:{a.name}",
                    "evaluate",
                    a.name,
                    q,
                    {"baseline_model": "merge", "baseline_eval": "evaluate:baseline"},
                    env_of=a,
                )
            )
        if r.benchmark.enabled:
            steps.append(step(f"benchmark:{a.name}", "benchmark", a.name, q))
        if r.package.enabled:
            refs = {"quantize": q, "merged": "merge"}
            if evaluate:
                refs |= {"evaluation": f"evaluate:{a.name}", "baseline_eval": "evaluate:baseline"}
            if r.benchmark.enabled:
                refs |= {"benchmark": f"benchmark:{a.name}", "baseline_benchmark": "benchmark:baseline"}
            steps.append(step(f"package:{a.name}", "package", a.name, q, refs))
    if backend == "vllm" and r.benchmark.enabled:
        ids = {s.id for s in steps}
        for s in steps:
            if s.kind == "evaluate" and s.env == "serve" and f"benchmark:{s.artifact}" in ids:
                s.joint = f"benchmark:{s.artifact}"
    return steps


def local_paths(recipe: Recipe, base_dir: str) -> set[str]:
    """Every local file or directory the recipe reads, found by walking its path-typed fields (recipe/paths.py), and the
    base directory: in a stage's key each one counts by its content, not its path. Places it writes to do not count."""
    return {base_dir} | {value for _, value, _ in input_paths(recipe)}


def _by_content(value, paths: set[str], hasher):
    if isinstance(value, str) and value in paths:
        return {"content": hasher.tree(Path(value))}
    if isinstance(value, dict):
        return {k: _by_content(v, paths, hasher) for k, v in value.items()}
    if isinstance(value, list):
        return [_by_content(v, paths, hasher) for v in value]
    return value


def compute_keys(steps: list[Step], recipe: Recipe, base_dir: str, hasher) -> None:
    """Each step's cache key: its input (local paths by content), its upstream keys, its code and its environment's lock."""
    paths = local_paths(recipe, base_dir)
    by_id: dict[str, Step] = {}
    for s in steps:
        upstream = {"src": by_id[s.src].key if s.src in by_id else None} | {
            role: by_id[sid].key for role, sid in s.refs.items() if sid in by_id
        }
        s.key = hash_json(
            {
                "kind": s.kind,
                "id": s.id,
                "input": _by_content(s.inp.model_dump(mode="json"), paths, hasher),
                "upstream": upstream,
                "code": source_hash(s.kind),
                "env": lock_hash(s.env),
            }
        )[:32]
        by_id[s.id] = s


def select(steps: list[Step], kinds: set[str] | None, artifacts: set[str] | None) -> list[Step]:
    """Steps to run for --stages/--artifacts, with everything they depend on."""
    by_id = {s.id: s for s in steps}
    wanted = {
        s.id
        for s in steps
        if (kinds is None or s.kind in kinds)
        and (artifacts is None or s.artifact in (None, "baseline") or s.artifact in artifacts)
    }
    todo = list(wanted)
    while todo:
        s = by_id[todo.pop()]
        for d in [s.src, *s.refs.values()]:
            if d in by_id and d not in wanted:
                wanted.add(d)
                todo.append(d)
    return [s for s in steps if s.id in wanted]
